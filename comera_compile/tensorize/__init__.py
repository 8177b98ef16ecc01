"""``tensorize_`` and what it builds: TT / TT-matrix weights for ``nn.Linear``, ``nn.Embedding`` and
transformers' ``Conv1D`` layers (the nn.Module floor above :mod:`comera_compile.tt`).

* :mod:`~comera_compile.tensorize.config`: :class:`TTConfig`;
* :mod:`~comera_compile.tensorize.parametrization`: :class:`TTParametrization` (a layer's weight as two
  flat Parameters of cores and gates), :func:`iter_tt_layers`;
* :mod:`~comera_compile.tensorize.transform`: :func:`tensorize_`, :func:`densify_`;
* :mod:`~comera_compile.tensorize.checkpoint`: ``save_pretrained`` with the TT layout
  (``comera_tt.json``) beside the weights;
* :mod:`~comera_compile.tensorize.compression`: :func:`compression_report`;
* :mod:`~comera_compile.tensorize.optim`: :func:`param_groups`.
"""

from comera_compile.tensorize.compression import CompressionReport, LayerReport, SkippedLayer, compression_report
from comera_compile.tensorize.config import TTConfig
from comera_compile.tensorize.optim import param_groups
from comera_compile.tensorize.parametrization import (
    TTLayer,
    TTParametrization,
    iter_tt_layers,
    require_unsharded,
    set_parameter_data_,
    tt_parametrization,
)
from comera_compile.tensorize.transform import densify_, tensorize_
from comera_compile.tt import TTSpec

__all__ = [
    "CompressionReport",
    "LayerReport",
    "SkippedLayer",
    "TTConfig",
    "TTLayer",
    "TTParametrization",
    "TTSpec",
    "compression_report",
    "densify_",
    "iter_tt_layers",
    "param_groups",
    "require_unsharded",
    "set_parameter_data_",
    "tensorize_",
    "tt_parametrization",
]
