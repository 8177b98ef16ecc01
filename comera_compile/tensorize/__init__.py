"""``tensorize_`` and what it builds: TT weights for ``nn.Linear`` / ``nn.Embedding`` layers."""

from comera_compile.tensorize.transform import *  # noqa: F401,F403
from comera_compile.tensorize.transform import __all__, tt_parametrization  # noqa: F401
