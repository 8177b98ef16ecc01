"""Source-checkout support for the package layout.

``passes/`` and ``kernels/`` sit at the repository root and ship as ``comera_compile.passes`` and
``comera_compile.kernels``. Neither has an ``__init__.py``: each is a namespace portion, so a checkout
on ``sys.path`` (``python -m pytest`` or ``python -c`` from the root, ``PYTHONPATH=.``) never shadows an
installed distribution's top-level module of the same name (Hugging Face's ``kernels``, which
transformers imports): a regular package later on the path wins over a namespace portion.

A wheel installs both folders inside ``comera_compile/``, where the import system finds them. An
editable install or a bare checkout has them beside the package instead; then a meta-path finder
answers for exactly ``comera_compile.passes`` and ``comera_compile.kernels`` with the checkout's
folders, and for no other name.
"""

from __future__ import annotations

import importlib.machinery
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
    """Finds ``comera_compile.passes``/``.kernels`` in a source checkout, as namespace packages."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        folder = _MAPPED.get(fullname)
        if folder is None or not os.path.isdir(os.path.join(_ROOT, folder)):
            return None
        spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
        spec.submodule_search_locations = [os.path.join(_ROOT, folder)]
        return spec


def install_checkout_finder() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    installed = any(os.path.isdir(os.path.join(here, folder)) for folder in _MAPPED.values())
    if installed or not _is_source_checkout():
        return
    if not any(f is _CheckoutFinder for f in sys.meta_path):
        sys.meta_path.insert(0, _CheckoutFinder)
