"""``compression_report``: every TT layer's shapes, format, ranks and parameters, the model's totals,
and the layers ``tensorize_`` left dense with the reason."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from comera_compile.fx_utils import unwrap_compiled
from comera_compile.tensorize.parametrization import iter_tt_layers, tt_parametrization

__all__ = ["CompressionReport", "LayerReport", "SkippedLayer", "compression_report", "record_skipped"]

_SKIPPED = "_comera_tensorize_skipped"  # the module attribute that holds what tensorize_ skipped in it


def record_skipped(model: nn.Module, skipped: dict[str, tuple[str, str]]) -> None:
    """Keep ``{fqn: (type name, reason)}`` of the layers ``tensorize_(model)`` left dense, for the report."""
    model.__dict__[_SKIPPED] = skipped


@dataclass(frozen=True)
class LayerReport:
    fqn: str
    kind: str
    weight_shape: tuple[int, int]
    fmt: str
    factorization: str
    padded_shape: tuple[int, int]
    ranks: tuple[int, ...]
    dense_params: int
    tt_params: int  # cores + gates
    init: str
    init_error: float | None  # init="svd": the relative error TT-SVD reached
    matrix_shape: tuple[int, int] = (0, 0)  # the TT matrix [rows, cols] (Linear: [in, out])
    shared_with: tuple[str, ...] = ()  # other modules whose weight is this TT (tied="share")
    svd_tol: float | None = None  # the tolerance asked for (TTConfig.svd_tol); not reached if init_error > it

    @property
    def ratio(self) -> float:
        return self.dense_params / max(self.tt_params, 1)


@dataclass(frozen=True)
class SkippedLayer:
    fqn: str
    kind: str
    reason: str


@dataclass(frozen=True)
class CompressionReport:
    """Per-layer and total parameter counts; ``print`` it for a table."""

    layers: tuple[LayerReport, ...]
    skipped: tuple[SkippedLayer, ...]
    dense_params: int  # the whole model with dense weights in place of the TT layers
    params: int  # the whole model as it is (cores and gates included)
    other_params: int = field(default=0)  # parameters outside the TT layers' weights

    @property
    def ratio(self) -> float:
        return self.dense_params / max(self.params, 1)

    def __str__(self) -> str:
        head = ("layer", "type", "weight", "fmt", "factorization", "ranks", "dense", "tt", "ratio", "note")
        rows = []
        for lay in self.layers:
            note = [] if lay.init_error is None else [f"svd err {lay.init_error:.3g}"]
            if lay.init_error is not None and lay.svd_tol is not None and lay.init_error > lay.svd_tol:
                note[-1] += f" > svd_tol {lay.svd_tol:g}"
            if lay.shared_with:
                note.append(f"shared with {', '.join(lay.shared_with)}")
            w, logical = lay.weight_shape, lay.matrix_shape
            if tuple(lay.padded_shape) != tuple(logical):
                note.append(f"padded {logical[0]}x{logical[1]}->{lay.padded_shape[0]}x{lay.padded_shape[1]}")
            rows.append((lay.fqn, lay.kind, "x".join(map(str, w)), lay.fmt, lay.factorization,
                         ",".join(map(str, lay.ranks)), f"{lay.dense_params:,}", f"{lay.tt_params:,}",
                         f"{lay.ratio:.1f}x", "; ".join(note)))
        widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]

        def fmt_row(r):
            return "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()

        lines = [fmt_row(head), fmt_row(["-" * w for w in widths])] + [fmt_row(r) for r in rows]
        lines.append(
            f"total: {self.dense_params:,} -> {self.params:,} parameters ({self.ratio:.1f}x); "
            f"{len(self.layers)} TT layers, other parameters {self.other_params:,}"
        )
        if self.skipped:
            lines.append("skipped:")
            lines += [f"  {s.fqn} ({s.kind}): {s.reason}" for s in self.skipped]
        return "\n".join(lines)


def compression_report(model: nn.Module) -> CompressionReport:
    """Shapes, factorization, format, ranks and parameters before/after of every TT layer,
    the model totals, and the layers ``tensorize_`` skipped with the reason."""
    model = unwrap_compiled(model)
    layers = []
    tt_param_ids = set()
    for layer in iter_tt_layers(model):
        p = tt_parametrization(layer.module)
        spec = layer.spec
        tt_param_ids.update((id(layer.param.core_flat), id(layer.param.gate_flat)))
        layers.append(LayerReport(
            fqn=layer.fqn, kind=p.kind, weight_shape=spec.weight_shape, fmt=spec.fmt,
            factorization=spec.describe(), padded_shape=(spec.padded_rows, spec.padded_cols),
            ranks=spec.ranks, dense_params=spec.dense_params,
            tt_params=sum(t.numel() for t in list(layer.cores) + list(layer.gates)),
            init=p.init, init_error=p.init_error, matrix_shape=(spec.rows, spec.cols),
            shared_with=layer.shared_with, svd_tol=p.svd_tol,
        ))
    params = {id(t): t.numel() for t in model.parameters()}
    other = sum(n for i, n in params.items() if i not in tt_param_ids)
    skipped = []
    for prefix, module in model.named_modules():
        for fqn, (kind, reason) in getattr(module, _SKIPPED, {}).items():
            name = f"{prefix}.{fqn}" if prefix and fqn else (prefix or fqn)
            skipped.append(SkippedLayer(name, kind, reason))
    return CompressionReport(
        layers=tuple(layers), skipped=tuple(skipped),
        dense_params=other + sum(lay.dense_params for lay in layers),
        params=sum(params.values()), other_params=other,
    )

