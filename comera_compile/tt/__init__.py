"""Tensor-train shape math and contraction plans: no nn.Module, no op.

* :mod:`comera_compile.tt.format`: the TT / TT-matrix / block tensor-train layouts (:class:`TTSpec`), factorization,
  the torch reference contraction and its vector-Jacobian product, TT-SVD;
* :mod:`comera_compile.tt.planner`: how a TT layer's contraction runs, costed on a device model.

``from comera_compile.tt import TTSpec, materialize, random_cores`` and the rest of
:mod:`comera_compile.tt.format`'s names import from here.
"""

from comera_compile.tt import format as _new
from comera_compile.tt.format import *  # noqa: F401,F403

__all__ = list(_new.__all__)
