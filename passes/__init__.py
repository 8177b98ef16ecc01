"""Graph passes of the comera backend, one per file, registered in running order on import.

Each pass is ``fn(gm, ctx) -> int``; see :mod:`comera_compile.pass_manager`. ``tensor_network`` runs
first: it lowers tensor-train layers into batched merges and plain GEMMs, so a TT LM head's second
factor is an ordinary ``linear`` by the time ``cce`` fuses the head with its loss.
"""

from comera_compile.passes import tensor_network  # noqa: F401  ("tensor_network": TT layers -> batched merges + GEMMs)
from comera_compile.passes import cce  # noqa: F401,E402  ("cce": LM head + cross-entropy -> fused op)
