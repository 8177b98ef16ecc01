"""A free local TCP port for a test's process group (its rendezvous), shared by the distributed tests."""

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
