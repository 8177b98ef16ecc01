"""``comera::tt_group_merge`` and its backward op ``comera::tt_group_merge_backward``: the
token-independent merges of a group of tensor-train layers
(:func:`~comera_compile.kernels.tt_runtime.group_outputs`) as one opaque op forward and one backward
that recomputes them.

:func:`group_outputs_opaque` is what the ``tensor_network`` pass puts into the graph for
``tt_merges="opaque"``, and under the default ``"auto"`` for the ``"tt"`` groups and the embedding groups;
Inductor then generates no kernels for the merges. Same values as
:func:`~comera_compile.kernels.tt_runtime.group_outputs`. Both ops take the layers' stacked storages and,
as typed arguments, the :class:`~comera_compile.tt.format.TTSpec`'s fields, the cut and the output kind
(:func:`~comera_compile.kernels.tt_runtime.merge_args`); they return one tensor per output kind, stacked
over the layers. The forward's fake allocates its outputs from the layout computed once per structure on
the meta device (:func:`~comera_compile.kernels.tt_runtime.stacked_layout`) instead of running the merges
under a fake mode; with symbolic sizes it runs them on the fake tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, Union

import torch

from comera_compile.kernels.tt_runtime import (
    OUTPUTS,
    Output,
    group_stacked,
    hashable_args,
    merge_args,
    per_layer,
    read_args,
    stack_flats,
    stacked_layout,
    static_shape,
)
from comera_compile.tt.format import TTSpec
from comera_compile.tt.planner import Cut

if TYPE_CHECKING:
    from comera_compile.tt.planner import TTPlan

__all__ = ["group_outputs_opaque"]


def _fresh(t: torch.Tensor, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``t`` as an op may return it: contiguous, and a copy where it shares storage with an input (a
    merge of one core can be a view of the stacked storage itself); otherwise ``t`` as it is."""
    t = t.contiguous()
    if any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for x in inputs):
        t = t.clone()
    return t


@torch.library.custom_op("comera::tt_group_merge", mutates_args=())
def _tt_group_merge(cores: torch.Tensor, gates: torch.Tensor, fmt: str, row_modes: list[int], col_modes: list[int],
                    ranks: list[int], rows: int, cols: int, transpose: bool, split: int, left: str, right: str,
                    output: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """The stacked outputs of :func:`~comera_compile.kernels.tt_runtime.group_stacked` (``cores``
    [K, numel], ``gates`` [K, n_gates]): one tensor per output kind, not one per layer, so the forward
    copies nothing per layer. The arguments after the tensors:
    :func:`~comera_compile.kernels.tt_runtime.merge_args`."""
    spec, cut, output, dtype = read_args(fmt, row_modes, col_modes, ranks, rows, cols, transpose, split, left,
                                         right, output, dtype)
    return [_fresh(t, (cores, gates)) for t in group_stacked(cores, gates, spec, cut, output, dtype)]


@_tt_group_merge.register_fake
def _(cores, gates, *args):
    shapes = static_shape(cores), static_shape(gates)
    if None in shapes:  # symbolic sizes: run the merges on the fake tensors
        spec, cut, output, dtype = read_args(*args)
        return [t.contiguous().clone() for t in group_stacked(cores, gates, spec, cut, output, dtype)]
    layout = stacked_layout(hashable_args(args), (shapes[0], cores.dtype), (shapes[1], gates.dtype))
    return [cores.new_empty(shape, dtype=dt) for shape, _, dt in layout]


@torch.library.custom_op("comera::tt_group_merge_backward", mutates_args=())
def _tt_group_merge_backward(cores: torch.Tensor, gates: torch.Tensor, grads: list[torch.Tensor], fmt: str,
                             row_modes: list[int], col_modes: list[int], ranks: list[int], rows: int, cols: int,
                             transpose: bool, split: int, left: str, right: str, output: str,
                             dtype: torch.dtype) -> list[torch.Tensor]:
    """The gradients of ``comera::tt_group_merge`` for ``cores`` and ``gates``: its merges recomputed
    with autograd on (an op's body runs below autograd: the guard puts the autograd keys back)."""
    spec, cut, output, dtype = read_args(fmt, row_modes, col_modes, ranks, rows, cols, transpose, split, left,
                                         right, output, dtype)
    if not all(hasattr(torch._C, name) for name in ("_ForceDispatchKeyGuard", "_dispatch_tls_local_exclude_set")):
        raise RuntimeError("tt_merges='opaque' needs torch's dispatch-key guards (torch._C._ForceDispatchKeyGuard), "
                           "which this torch lacks; compile with options={'tt_merges': 'inductor'}")
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.AutogradFunctionality)
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        leaves = [cores.detach().requires_grad_(), gates.detach().requires_grad_()]
        outs = group_stacked(leaves[0], leaves[1], spec, cut, output, dtype, split=True)
        got = torch.autograd.grad(outs, leaves, list(grads), allow_unused=True)
    return [torch.zeros_like(t) if g is None else _fresh(g, list(grads) + [cores, gates])
            for t, g in zip(leaves, got)]


@_tt_group_merge_backward.register_fake
def _(cores, gates, grads, *args):
    return [torch.empty_like(cores), torch.empty_like(gates)]


def _merge_setup(ctx, inputs, output) -> None:
    cores, gates, *args = inputs
    ctx.args, ctx.shapes = args, [(o.shape, o.dtype) for o in output]
    ctx.save_for_backward(cores, gates)


def _merge_backward(ctx, grads):
    cores, gates = ctx.saved_tensors
    # an output kind the loss does not reach may come as None: its gradient is zero
    grads = [torch.zeros(shape, dtype=dtype, device=cores.device) if g is None else g
             for g, (shape, dtype) in zip(grads, ctx.shapes)]
    g_cores, g_gates = torch.ops.comera.tt_group_merge_backward(cores, gates, grads, *ctx.args)
    return (g_cores, g_gates) + (None,) * len(ctx.args)


_tt_group_merge.register_autograd(_merge_backward, setup_context=_merge_setup)


def group_outputs_opaque(core_flats: Sequence[torch.Tensor], gate_flats: Sequence[torch.Tensor], spec: TTSpec,
                         plan: Union[Cut, "TTPlan"], output: Output, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """:func:`~comera_compile.kernels.tt_runtime.group_outputs` as one opaque op forward
    (``comera::tt_group_merge``) and one backward (``comera::tt_group_merge_backward``, which recomputes
    the merges): the backend's ``tt_merges="opaque"``, where Inductor generates no kernels for the
    merges. Same values."""
    if output not in OUTPUTS:
        raise ValueError(f"group_outputs: output={output!r}; valid values: {list(OUTPUTS)}")
    # the storages stacked and the outputs unbound in the graph (one stack per storage, views per layer)
    stacked = torch.ops.comera.tt_group_merge(stack_flats(core_flats), stack_flats(gate_flats),
                                              *merge_args(spec, plan, output, dtype))
    return per_layer(*stacked)
