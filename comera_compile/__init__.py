"""comera-compile: a torch.compile backend for tensor-compressed training.

``torch.compile(model, backend="comera")`` rewrites the costly patterns of a training graph (the
LM head + cross-entropy, tensor-train Linear/Embedding layers) into fused ops with Triton kernels,
then hands the graph to Inductor.
"""

from comera_compile._layout import install_checkout_finder as _install_checkout_finder

_install_checkout_finder()

from comera_compile._logging import logger  # noqa: E402
from comera_compile.backend import comera_backend  # noqa: E402
from comera_compile.explain import explain  # noqa: E402
from comera_compile.inductor import use_with_inductor  # noqa: E402  (the passes in plain torch.compile)
from comera_compile import hf  # noqa: E402  (cc.hf.fused_loss: the transformers labels path)
from comera_compile.options import CompileOptions, OptionsError  # noqa: E402
from comera_compile.pass_manager import PassContext, list_passes, register_pass, unregister_pass  # noqa: E402
from comera_compile.report import Report, RewriteRecord, SkipRecord  # noqa: E402
from comera_compile.fx_utils import RewriteRejected, checked_replace  # noqa: E402
from comera_compile import matching  # noqa: E402  (the matching vocabulary shared by passes)
from comera_compile.tt import TTSpec  # noqa: E402
from comera_compile.tensorize import (  # noqa: E402
    CompressionReport,
    TTConfig,
    compression_report,
    densify_,
    iter_tt_layers,
    tensorize_,
)
from comera_compile.tt.planner import plan_tt_embedding, plan_tt_linear  # noqa: E402
from comera_compile.rank_adaptation import RankAdaptation, RankConfig  # noqa: E402
from comera_compile.tensorize.optim import param_groups  # noqa: E402
from comera_compile.kernels.linear_cross_entropy import linear_cross_entropy  # noqa: E402
from comera_compile.losses import FusedLinearCrossEntropyLoss  # noqa: E402  (the head apart from the model: torchtitan)
from comera_compile.kernels.tt_embedding import tt_embedding  # noqa: E402
from comera_compile.kernels.tt_linear import tt_linear  # noqa: E402
from comera_compile.kernels.tt_materialize import tt_materialize  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "CompileOptions",
    "CompressionReport",
    "FusedLinearCrossEntropyLoss",
    "OptionsError",
    "PassContext",
    "RankAdaptation",
    "RankConfig",
    "Report",
    "RewriteRecord",
    "RewriteRejected",
    "SkipRecord",
    "TTConfig",
    "TTSpec",
    "checked_replace",
    "comera_backend",
    "compile",
    "compression_report",
    "densify_",
    "explain",
    "hf",
    "iter_tt_layers",
    "linear_cross_entropy",
    "list_passes",
    "logger",
    "matching",
    "param_groups",
    "plan_tt_embedding",
    "plan_tt_linear",
    "register_pass",
    "tensorize_",
    "tt_embedding",
    "tt_linear",
    "tt_materialize",
    "unregister_pass",
    "use_with_inductor",
]


def compile(model, *, options=None, mode=None, **compile_kwargs):
    """``torch.compile(model, backend="comera", ...)`` with the options validated right away: a bad
    value, or a pass name that no registered pass has, raises here rather than at the first call."""
    import torch

    from comera_compile.pass_manager import validated_options

    validated_options(options, mode)
    return torch.compile(model, backend="comera", options=options or None, mode=mode, **compile_kwargs)


def _register_fallback() -> None:
    """Register the backend for source checkouts, where no entry point exists.

    An unconditional ``register_backend(name="comera")`` breaks the entry-point path with
    ``AssertionError: duplicate name``: register only when the name is unknown.
    """
    import torch._dynamo
    from torch._dynamo.backends.registry import register_backend

    if "comera" not in torch._dynamo.list_backends(exclude_tags=()):
        register_backend(compiler_fn=comera_backend, name="comera")


_register_fallback()
