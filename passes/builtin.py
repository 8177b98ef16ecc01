"""The built-in graph passes of the comera backend and their running order.

``passes/`` holds one pass per file and has no ``__init__.py``: it is a namespace portion, so that a
checkout on ``sys.path`` never shadows an installed top-level ``passes`` module (see DESIGN.md,
"Layout"). Each pass is ``fn(gm, ctx) -> int``; see :mod:`comera_compile.pass_manager`. ``BUILTIN_PASSES`` is their
running order, written once here: ``tensor_network`` runs first, lowering tensor-train layers into
batched merges and plain GEMMs, so that a TT LM head's second factor is an ordinary ``linear`` by the
time ``cce`` fuses the head with its loss. The pass modules define their pass and register nothing
themselves.
"""

from comera_compile.passes import cce, tensor_network

#: (name, pass) of the built-in passes, in running order.
BUILTIN_PASSES = (
    (tensor_network.NAME, tensor_network.tensor_network_pass),  # TT layers -> batched merges + GEMMs
    (cce.KIND, cce.cce_pass),  # LM head + cross-entropy -> one fused op
)
