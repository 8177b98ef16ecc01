import subprocess
import sys
import textwrap

import torch


def test_entry_point_works_without_importing_the_package():
    code = textwrap.dedent("""
        import sys, torch
        f = torch.compile(lambda x: x * 3, backend="comera", options={"inner": "eager"})
        assert float(f(torch.ones(2)).sum()) == 6.0
        print("comera_compile imported by torch:", "comera_compile" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "imported by torch: True" in out.stdout


def test_import_after_entry_point_load_does_not_duplicate():
    import comera_compile  # noqa: F401  (fallback registration must be guarded)

    assert "comera" in torch._dynamo.list_backends(exclude_tags=())
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("comera") is comera_compile.comera_backend or callable(lookup_backend("comera"))
