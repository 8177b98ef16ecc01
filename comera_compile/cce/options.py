"""The options of one call of ``comera::linear_cross_entropy`` (:class:`LCEOptions`): every argument that
is not a tensor, checked once, here. Shared by the public function, the cce pass, the op and its
autograd.

Pure: nothing here runs an op or reads a schema. The ops take the options flat after their tensors, in
their schemas' orders; ``comera_compile.kernels.linear_cross_entropy``, which registers the ops, reads
those orders from the registered schemas and hands them over (:func:`set_op_field_orders`) before any
caller can build the op's arguments (:meth:`LCEOptions.op_args`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from comera_compile.cce.planner import BACKWARDS, FORWARD_DX_MAX_D, REDUCTIONS, STRATEGIES
from comera_compile.cce.tuning import default_filter_eps
from comera_compile.devices import IMPLS

__all__ = ["IMPLS", "LCEOptions", "set_op_field_orders"]


# Each op's option arguments in its schema's order ("forward": comera::linear_cross_entropy,
# "backward": comera::linear_cross_entropy_backward), set by the module that registers the ops.
_ORDERS: dict[str, tuple[str, ...]] = {}


@dataclass(frozen=True)
class LCEOptions:
    """Every non-tensor argument of ``comera::linear_cross_entropy``, checked once (here).

    The ops take them flat after their tensors (``torch.library`` schemas take primitive
    arguments), and every caller goes through this class: the call is
    ``torch.ops.comera.linear_cross_entropy(x, weight, target, bias, *options.op_args())``, and
    ``LCEOptions.from_op_args(args)`` reads the arguments back (the fake, the autograd setup); the
    backward op likewise with :meth:`backward_op_args` / :meth:`from_backward_op_args`. Each op's
    order is read from its registered schema (:func:`set_op_field_orders`), so no caller spells a
    position.

    * ``softcap``: ``c`` of ``c * tanh(z / c)`` over the logits, 0 (or None) for none.
    * ``ignore_index``, ``label_smoothing``, ``reduction``: as in ``F.cross_entropy``.
    * ``backward``, ``filter_eps``, ``deterministic``, ``strategy``, ``memory_budget``, ``impl``: see
      ``comera_compile.linear_cross_entropy``. ``filter_eps=None`` stands for the inputs' dtype's
      default, filled in by :meth:`resolve`; ``memory_budget`` -1 (or None) for the default budget.
    * ``need_dx``, ``need_dw``, ``need_db``: the gradients to form (in the forward: those the
      chunked and fused paths may form there; in the backward: those to compute).
    * ``adaptive``: ``strategy`` was planned by "auto" (not pinned): where the sparse path may run,
      the op re-decides when it runs between the planned path and sparse rounds with the same
      outputs, from the observed kept fraction (``runtime_strategy``). The output shapes still
      follow ``strategy`` alone (:meth:`forms_grads`).

    Invalid values raise ``ValueError`` naming the argument and the valid values. The values are
    stored in the op's types (float, int, str, bool).
    """

    softcap: Optional[float] = 0.0
    ignore_index: int = -100
    label_smoothing: float = 0.0
    reduction: str = "mean"
    backward: str = "filtered"
    filter_eps: Optional[float] = None
    deterministic: bool = False
    impl: str = "auto"
    strategy: str = "auto"
    memory_budget: Optional[int] = -1
    need_dx: bool = False
    need_dw: bool = False
    need_db: bool = False
    adaptive: bool = False

    def __post_init__(self) -> None:
        for name, valid in (("reduction", REDUCTIONS), ("backward", BACKWARDS), ("strategy", STRATEGIES),
                            ("impl", IMPLS)):
            if getattr(self, name) not in valid:
                raise ValueError(f"linear_cross_entropy: {name}={getattr(self, name)!r}; valid values: {list(valid)}")
        softcap = float(self.softcap or 0.0)
        if softcap < 0.0:
            raise ValueError(f"linear_cross_entropy: softcap={softcap} must be >= 0 (0 or None: no soft-cap)")
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"linear_cross_entropy: label_smoothing={self.label_smoothing} not in [0, 1]")
        if self.filter_eps is not None and not self.filter_eps >= 0.0:
            raise ValueError(f"linear_cross_entropy: filter_eps={self.filter_eps} must be >= 0 "
                             "(or None for the dtype's default)")
        budget = -1 if self.memory_budget is None else int(self.memory_budget)
        if budget < -1:
            raise ValueError(f"linear_cross_entropy: memory_budget={self.memory_budget} must be a byte count "
                             "(or None/-1 for the default)")
        typed = dict(softcap=softcap, ignore_index=int(self.ignore_index), label_smoothing=float(self.label_smoothing),
                     filter_eps=None if self.filter_eps is None else float(self.filter_eps),
                     deterministic=bool(self.deterministic), memory_budget=budget, need_dx=bool(self.need_dx),
                     need_dw=bool(self.need_dw), need_db=bool(self.need_db), adaptive=bool(self.adaptive))
        for name, value in typed.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_op_args(cls, args) -> "LCEOptions":
        """The options from the op's arguments after ``(x, weight, target, bias)``."""
        return cls(**dict(zip(_order("forward"), args)))

    @classmethod
    def from_backward_op_args(cls, args) -> "LCEOptions":
        """The options from the backward op's arguments after its eight tensors."""
        return cls(**dict(zip(_order("backward"), args)))

    def op_args(self) -> tuple:
        """The op's arguments after ``(x, weight, target, bias)``, in its schema's order."""
        return self._args(_order("forward"))

    def backward_op_args(self) -> tuple:
        """The backward op's arguments after its eight tensors, in its schema's order."""
        return self._args(_order("backward"))

    def _args(self, names: tuple[str, ...]) -> tuple:
        if self.filter_eps is None:
            raise ValueError("linear_cross_entropy: filter_eps=None must be resolved for the inputs' dtype "
                             "(LCEOptions.resolve) before the op is called")
        return tuple(getattr(self, name) for name in names)

    def resolve(self, dtype: torch.dtype) -> "LCEOptions":
        """These options with ``filter_eps`` set (the default of ``dtype`` when it is None)."""
        if self.filter_eps is not None:
            return self
        return dataclasses.replace(self, filter_eps=default_filter_eps(dtype))

    def with_needs(self, need_dx: bool, need_dw: bool, need_db: bool) -> "LCEOptions":
        """These options asking for the given gradients."""
        return dataclasses.replace(self, need_dx=need_dx, need_dw=need_dw, need_db=need_db)

    def cost_model_args(self) -> dict:
        """The keyword arguments of ``choose_strategy`` and ``fused_loss_pays`` for these options."""
        return dict(reduction=self.reduction, backward=self.backward, deterministic=self.deterministic,
                    memory_budget=None if self.memory_budget < 0 else self.memory_budget,
                    filter_eps=self.filter_eps)

    def filters(self) -> bool:
        """Whether the backward may filter tiles: "filtered" with a positive threshold, and not
        softcap with label smoothing together (the smoothing term then sits in every tile)."""
        return (self.backward == "filtered" and self.filter_eps is not None and self.filter_eps > 0.0
                and not (self.label_smoothing > 0.0 and self.softcap > 0.0))

    def forms_grads(self, hidden, has_bias: bool) -> tuple[bool, bool, bool]:
        """Which of (dx, dw, db) the forward forms, for grad_output = 1: all asked for on the chunked
        path; dx on the fused path when D fits one K step (and no label smoothing). Decided by the
        options and shapes alone, so that the fake and the real op agree on the output shapes."""
        if self.reduction == "none":
            return False, False, False
        if self.strategy == "chunked":
            return self.need_dx, self.need_dw, self.need_db and has_bias
        if self.strategy == "fused" and self.label_smoothing == 0.0 and hidden <= FORWARD_DX_MAX_D:
            return self.need_dx, False, False
        return False, False, False


def set_op_field_orders(forward: Sequence[str], backward: Sequence[str]) -> None:
    """Record the orders in which the op (``forward``) and its backward op (``backward``) take the
    fields of :class:`LCEOptions` after their tensors: each must name every field exactly once
    (``AssertionError`` otherwise). The module that registers the ops calls it with the orders of their
    registered schemas; until then :meth:`LCEOptions.op_args` and its kin raise ``RuntimeError``."""
    fields = tuple(f.name for f in dataclasses.fields(LCEOptions))
    for kind, names in (("forward", tuple(forward)), ("backward", tuple(backward))):
        if sorted(names) != sorted(fields):
            raise AssertionError(f"linear_cross_entropy ({kind} op): arguments {names} are not the fields of "
                                 f"LCEOptions {sorted(fields)}")
        _ORDERS[kind] = names


def _order(kind: str) -> tuple[str, ...]:
    try:
        return _ORDERS[kind]
    except KeyError:
        raise RuntimeError("LCEOptions: the op's argument order is not known until the op is defined: import "
                           "comera_compile.kernels.linear_cross_entropy first") from None
