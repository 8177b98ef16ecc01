"""``param_groups``'s old path: :mod:`comera_compile.tensorize.optim` re-exported, so that
``from comera_compile.optim import param_groups`` keeps working.
Deprecated: importing it warns; it will be removed in the next release (import :mod:`comera_compile.tensorize.optim`)."""

import warnings

from comera_compile.tensorize import optim as _new
from comera_compile.tensorize.optim import *  # noqa: F401,F403

__all__ = list(_new.__all__)

warnings.warn("comera_compile.optim is deprecated and will be removed in the next release: import comera_compile.tensorize.optim "
              "(the same names)", DeprecationWarning, stacklevel=2)
