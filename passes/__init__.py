"""Graph passes of the comera backend, one per file, registered in running order on import.

Each pass is ``fn(gm, ctx) -> int``; see :mod:`comera_compile.pass_manager`.
"""

from comera_compile.passes import cce  # noqa: F401  ("cce": LM head + cross-entropy -> fused op)
from comera_compile.passes import tensor_network  # noqa: F401,E402  ("tensor_network": TT layers -> tt_linear/tt_embedding)
