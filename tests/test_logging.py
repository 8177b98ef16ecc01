import os
import subprocess
import sys
import textwrap

CODE = textwrap.dedent("""
    import torch, torch.nn.functional as F
    import comera_compile
    lin = torch.nn.Linear(4, 7)
    f = lambda x, y: F.cross_entropy(lin(x), y)
    torch.compile(f, backend="comera", options={"inner": "eager", "cce_min_vocab": 0})(torch.randn(3, 4), torch.tensor([0, 1, 2]))
""")


def _run(value):
    env = dict(os.environ, COMERA_LOG=value)
    return subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300, env=env)


def test_env_var_turns_on_package_logging():
    out = _run("info")
    assert out.returncode == 0, out.stderr
    assert "[comera_compile INFO] rewrite [cce]" in out.stderr


def test_an_application_root_handler_gets_each_line_once():
    """torchtitan (and ``logging.basicConfig``) put a handler on the root logger: with COMERA_LOG set, each
    comera line is printed once, in the application's format, instead of twice."""
    env = dict(os.environ, COMERA_LOG="info")
    code = "import logging; logging.basicConfig(level=logging.INFO, format='APP %(name)s %(message)s')\n" + CODE
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if "rewrite [cce]" in line]
    assert len(lines) == 1 and lines[0].startswith("APP comera_compile"), out.stderr
    # a root handler that drops INFO leaves the line to comera's own handler
    code = ("import logging; h = logging.StreamHandler(); h.setLevel(logging.WARNING); "
            "logging.getLogger().addHandler(h)\n" + CODE)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    lines = [line for line in out.stderr.splitlines() if "rewrite [cce]" in line]
    assert len(lines) == 1 and lines[0].startswith("[comera_compile INFO]"), out.stderr


def test_bad_env_var_value_names_valid_levels():
    out = _run("loud")
    assert out.returncode != 0
    assert "COMERA_LOG='loud'" in out.stderr and "debug" in out.stderr


def test_compiling_and_compiled_lines_at_info(caplog):
    """A first compile can take a minute: the backend says what it is compiling and how long it took."""
    import logging

    import torch
    import torch.nn.functional as F

    import comera_compile  # noqa: F401

    lin = torch.nn.Linear(4, 7)
    with caplog.at_level(logging.INFO, logger="comera_compile"):
        torch.compile(lambda x, y: F.cross_entropy(lin(x), y), backend="comera",
                      options={"inner": "aot_eager", "cce_min_vocab": 0})(torch.randn(3, 4), torch.tensor([0, 1, 2]))
    messages = [r.getMessage() for r in caplog.records if r.name == "comera_compile"]
    start = [m for m in messages if m.startswith("comera: compiling graph")]
    done = [m for m in messages if " compiled in " in m]
    assert len(start) == 1 and " nodes): passes tensor_network, cce, then aot_eager" in start[0], messages
    assert len(done) == 1 and "s (passes " in done[0] and "its backward compiles at the first backward" in done[0]
    assert messages.index(start[0]) < messages.index(done[0])


def test_backward_compile_is_logged(caplog):
    """AOTAutograd compiles the backward after the backend returned, at the first backward: the log
    says when, after the forward's lines."""
    import logging

    import torch
    import torch.nn.functional as F

    lin = torch.nn.Linear(4, 7)
    fn = torch.compile(lambda x, y: F.cross_entropy(lin(x), y), backend="comera", options={"cce_min_vocab": 0})
    torch._dynamo.reset()
    # An earlier test of the same graph may have left it in the AOTAutograd cache, which brings the
    # backward with the forward (the next test): this one needs a real compile.
    with caplog.at_level(logging.INFO, logger="comera_compile"), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        loss = fn(torch.randn(3, 4), torch.tensor([0, 1, 2]))
        forward_only = [r.getMessage() for r in caplog.records if r.name == "comera_compile"]
        loss.backward()
    messages = [r.getMessage() for r in caplog.records if r.name == "comera_compile"]
    backward = [m for m in messages if "backward" in m and m not in forward_only]
    assert not [m for m in forward_only if "'s backward" in m], forward_only
    assert len(backward) == 2, messages
    assert backward[0].startswith("comera: compiling graph ") and backward[0].endswith("'s backward")
    assert backward[1].startswith("comera: graph ") and "'s backward compiled in " in backward[1]
    assert lin.weight.grad is not None


def test_backward_from_the_aot_cache_is_not_announced(caplog, tmp_path, monkeypatch):
    """When AOTAutograd loads the graph from its cache, the compiled backward comes with it: the log says
    so instead of promising a backward compile that never happens."""
    import logging

    import torch
    import torch.nn.functional as F

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a cache this test owns
    lin = torch.nn.Linear(5, 9)

    def run():
        torch._dynamo.reset()
        fn = torch.compile(lambda x, y: F.cross_entropy(lin(x), y), backend="comera", options={"cce_min_vocab": 0})
        caplog.clear()
        loss = fn(torch.randn(3, 5), torch.tensor([0, 1, 2]))
        loss.backward()
        return [r.getMessage() for r in caplog.records if r.name == "comera_compile"]

    with caplog.at_level(logging.INFO, logger="comera_compile"), \
            torch._functorch.config.patch(enable_autograd_cache=True), \
            torch._inductor.config.patch(fx_graph_cache=True):
        first = run()
        second = run()
    assert any("its backward compiles at the first backward" in m for m in first), first
    assert any(m.endswith("'s backward") for m in first), first
    done = [m for m in second if " compiled in " in m]
    assert len(done) == 1 and "loaded from the AOTAutograd cache" in done[0], second
    assert not [m for m in second if "backward compiles" in m or m.endswith("'s backward")], second


def test_nothing_printed_by_default():
    env = {k: v for k, v in os.environ.items() if k != "COMERA_LOG"}
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert "compiling" not in out.stdout + out.stderr and "compiled in" not in out.stdout + out.stderr
