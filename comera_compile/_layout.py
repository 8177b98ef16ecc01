"""Source-checkout support for the package layout.

In an installed package (normal or editable) ``passes/`` and ``kernels/`` are mapped to
``comera_compile.passes`` and ``comera_compile.kernels`` by ``pyproject.toml``. When the code runs
straight from a git checkout (``PYTHONPATH=.``), nothing maps them, so we extend this package's
``__path__`` with the checkout root *only* for those two names: a meta-path finder that answers
for exactly ``comera_compile.passes`` and ``comera_compile.kernels``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MAPPED = {"comera_compile.passes": "passes", "comera_compile.kernels": "kernels"}


def _is_source_checkout() -> bool:
    pyproject = os.path.join(_ROOT, "pyproject.toml")
    if not os.path.isfile(pyproject):
        return False
    with open(pyproject, encoding="utf-8") as f:
        return 'name = "comera-compile"' in f.read()


class _CheckoutFinder:
    """Finds ``comera_compile.passes``/``.kernels`` in a source checkout."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        folder = _MAPPED.get(fullname)
        if folder is None:
            return None
        init = os.path.join(_ROOT, folder, "__init__.py")
        if not os.path.isfile(init):
            return None
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=[os.path.join(_ROOT, folder)]
        )


def install_checkout_finder() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    installed = any(
        importlib.machinery.PathFinder.find_spec(name.rsplit(".", 1)[1], [here]) is not None
        for name in _MAPPED
    )
    if installed or not _is_source_checkout():
        return
    if not any(f is _CheckoutFinder for f in sys.meta_path):
        sys.meta_path.insert(0, _CheckoutFinder)
