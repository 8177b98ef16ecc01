"""``param_groups``'s old path: :mod:`comera_compile.tensorize.optim` re-exported, so that
``from comera_compile.optim import param_groups`` keeps working."""

from comera_compile.tensorize import optim as _new
from comera_compile.tensorize.optim import *  # noqa: F401,F403

__all__ = list(_new.__all__)
