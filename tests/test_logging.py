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


def test_bad_env_var_value_names_valid_levels():
    out = _run("loud")
    assert out.returncode != 0
    assert "COMERA_LOG='loud'" in out.stderr and "debug" in out.stderr
