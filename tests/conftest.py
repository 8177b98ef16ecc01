import os

# Kernels run under the Triton interpreter on machines without a GPU. The variable is read when
# @triton.jit decorates, so it must be set before any kernel module is imported.
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts from a clean Dynamo cache (torchao habit)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def one_thread():
    """One intra-op thread: tiny models run several times faster than with two on a busy 2-core
    machine. Modules of tiny-model tests use it with ``pytestmark = pytest.mark.usefixtures``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)



def pytest_terminal_summary(terminalreporter):
    """The fuzzers' seed, at the end of every run (``-q`` and CI logs included): the default run is
    derandomized; ``COMERA_FUZZ_SEED=<int>`` draws other examples and replays them."""
    seed = os.environ.get("COMERA_FUZZ_SEED")
    terminalreporter.write_line(
        "comera fuzzers (cce, cce edges, tensorized models, rank adaptation): "
        + (f"COMERA_FUZZ_SEED={seed}" if seed else "derandomized (COMERA_FUZZ_SEED=<int> draws other examples)"))
