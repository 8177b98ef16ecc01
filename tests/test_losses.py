"""``FusedLinearCrossEntropyLoss``: the fused LM-head loss where the head and the loss are apart
(torchtitan's loss call), without torchtitan: values and gradients against float64 eager, the
logits never formed, gradient accumulation, ignore_index, and FSDP2 on 2 CPU processes over gloo."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from comera_compile.losses import IGNORE_INDEX, FusedLinearCrossEntropyLoss
from ports import spawn

pytestmark = pytest.mark.usefixtures("one_thread")

V, D = 96, 16


class TinyLM(nn.Module):
    """Embedding, one block, a norm and a head that the model's forward skips (torchtitan's
    ``_skip_lm_head``): ``forward`` returns the hidden states."""

    def __init__(self, vocab: int = V, dim: int = D):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.block = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.norm(self.emb(idx) + F.gelu(self.block(self.emb(idx))))


def _labels(shape, seed: int, ignored: float = 0.25) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, V, shape, generator=g)
    y[torch.rand(shape, generator=g) < ignored] = IGNORE_INDEX
    return y


def _assert_matches_reference(model: nn.Module, batches, loss: torch.Tensor) -> None:
    """``loss`` and the gradients ``model`` holds equal :func:`_reference_loss`'s (float64 eager) and its
    gradients."""
    ref, ref_loss = _reference_loss(model, batches)
    ref_loss.backward()
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.double(), q.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _reference_loss(model: nn.Module, batches) -> torch.Tensor:
    """float64 eager: ``F.cross_entropy(F.linear(h, W), y)`` over every valid token of ``batches``."""
    ref = copy.deepcopy(model).double()
    h = torch.cat([ref(idx).reshape(-1, D) for idx, _ in batches])
    y = torch.cat([lab.reshape(-1) for _, lab in batches])
    return ref, F.cross_entropy(F.linear(h, ref.lm_head.weight), y, ignore_index=IGNORE_INDEX)


def test_loss_and_gradients_match_float64_eager_with_ignore_index():
    torch.manual_seed(0)
    model = TinyLM()
    idx, y = torch.randint(0, V, (3, 10)), _labels((3, 10), 1)
    loss_fn = FusedLinearCrossEntropyLoss(model.lm_head)
    valid = (y != IGNORE_INDEX).sum()
    loss, metrics = loss_fn(model(idx), y, valid)
    loss.backward()
    assert metrics == {} and loss.dtype == torch.float32 and loss.dim() == 0
    _assert_matches_reference(model, [(idx, y)], loss)


def test_without_global_valid_tokens_the_loss_is_the_sum_as_torchtitan_returns_it():
    torch.manual_seed(0)
    h, w = torch.randn(12, D, dtype=torch.float64), torch.randn(V, D, dtype=torch.float64)
    y = _labels((12,), 2)
    head = nn.Linear(D, V, bias=False).double()
    with torch.no_grad():
        head.weight.copy_(w)
    loss, _ = FusedLinearCrossEntropyLoss(head)(h, y)
    want = F.cross_entropy(h @ w.T, y, ignore_index=IGNORE_INDEX, reduction="sum")
    assert loss.dtype == torch.float32  # the op's loss is fp32, whatever the inputs' dtype
    torch.testing.assert_close(loss.double(), want, rtol=1e-6, atol=1e-5)


def test_gradient_accumulation_equals_one_batch_of_every_microbatch():
    """torchtitan's accumulation: each microbatch's summed loss over the step's valid-token count,
    backward per microbatch; the losses add up to the step's mean and the gradients to one batch's."""
    torch.manual_seed(0)
    model = TinyLM()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, V, (2, 8), generator=g), _labels((2, 8), 10 + i, ignored=0.1 + 0.3 * i))
               for i in range(3)]
    global_valid = sum((lab != IGNORE_INDEX).sum() for _, lab in batches)
    loss_fn = FusedLinearCrossEntropyLoss(model.lm_head)
    total = 0.0
    for idx, lab in batches:
        loss, _ = loss_fn(model(idx), lab, global_valid)
        loss.backward()
        total = total + loss.detach()
    _assert_matches_reference(model, batches, total)


def test_a_microbatch_with_every_label_ignored_adds_nothing():
    torch.manual_seed(0)
    model = TinyLM()
    y = torch.full((2, 5), IGNORE_INDEX)
    loss, _ = FusedLinearCrossEntropyLoss(model.lm_head)(model(torch.randint(0, V, (2, 5))), y, torch.tensor(7))
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_validation_runs_the_forward_only():
    torch.manual_seed(0)
    model = TinyLM()
    idx, y = torch.randint(0, V, (2, 6)), _labels((2, 6), 4)
    loss_fn = FusedLinearCrossEntropyLoss(model.lm_head)
    with torch.no_grad():
        loss, _ = loss_fn(model(idx), y, (y != IGNORE_INDEX).sum())
    assert not loss.requires_grad and model.lm_head.weight.grad is None
    with torch.no_grad():
        want = F.cross_entropy(model.lm_head(model(idx)).reshape(-1, V), y.reshape(-1), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)


def test_the_loss_scales_the_hidden_gradient_by_grad_output():
    torch.manual_seed(0)
    model = TinyLM()
    idx, y = torch.randint(0, V, (2, 6)), _labels((2, 6), 5)
    loss_fn = FusedLinearCrossEntropyLoss(model.lm_head)
    (3.0 * loss_fn(model(idx), y)[0]).backward()
    block_grad = model.block.weight.grad.clone()
    model.zero_grad()
    loss_fn(model(idx), y)[0].backward()
    torch.testing.assert_close(block_grad, 3.0 * model.block.weight.grad)


class _OutputShapes(TorchDispatchMode):
    """Every op's output shapes, as the dispatcher sees them."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [(str(func), tuple(t.shape)) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        return out


def _largest_allocation(fn) -> int:
    """The largest single CPU allocation (bytes) any op makes while ``fn`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(e.cpu_memory_usage for e in prof.events())


def test_the_logits_are_never_materialized():
    """No op outputs an [N, V] tensor, and inside the fused op no allocation reaches the logits' size:
    with ``memory_budget`` at 1/8 of the fp32 logits the op works 1/8 of the tokens at a time (its
    documented chunking). The same probes see the logits of the unfused head."""
    torch.manual_seed(0)
    n, vocab, dim = 512, 1000, 32
    head = nn.Linear(dim, vocab, bias=False)
    h = torch.randn(n, dim, requires_grad=True)
    y = torch.randint(0, vocab, (n,))
    logits_bytes = n * vocab * 4
    loss_fn = FusedLinearCrossEntropyLoss(head, memory_budget=logits_bytes // 8)

    def fused():
        loss_fn(h, y)[0].backward()

    def unfused():
        F.cross_entropy(head(h), y, reduction="sum").backward()

    with _OutputShapes() as seen:
        fused()
    assert ("comera.linear_cross_entropy.default", ()) in seen.shapes
    assert not [s for s in seen.shapes if s[1] and s[1][-1] == vocab and len(s[1]) == 2 and s[1][0] == n], seen.shapes
    assert _largest_allocation(fused) <= logits_bytes // 8
    with _OutputShapes() as seen_unfused:
        unfused()
    assert ("aten.mm.default", (n, vocab)) in seen_unfused.shapes
    assert _largest_allocation(unfused) >= logits_bytes


def test_errors_name_what_is_missing():
    with pytest.raises(TypeError, match="unknown option"):
        FusedLinearCrossEntropyLoss(reduction="mean")
    with pytest.raises(RuntimeError, match="set_lm_head"):
        FusedLinearCrossEntropyLoss()(torch.randn(2, 3, D), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="labels' shape"):
        FusedLinearCrossEntropyLoss(nn.Linear(D, V))(torch.randn(2, 3, D), torch.zeros(2, 4, dtype=torch.long))


# ------------------------------------------------------------------------------------------------
# FSDP2 on 2 CPU processes (gloo): the head sharded, unsharded once per call, gradients exact
# ------------------------------------------------------------------------------------------------

WORLD = 2
MICRO = 2


def _global_batches():
    """[rank][microbatch] -> (idx, labels)."""
    g = torch.Generator().manual_seed(7)
    return [[(torch.randint(0, V, (2, 8), generator=g), _labels((2, 8), 100 + 10 * r + m))
             for m in range(MICRO)] for r in range(WORLD)]


def _fsdp_scenario(rank: int, grouped: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    torch.manual_seed(0)
    model = TinyLM()
    mesh = init_device_mesh("cpu", (WORLD,))
    fully_shard(model.block, mesh=mesh)
    if grouped:  # torchtitan's layout: the final norm and the head in one FSDP unit, kept after forward
        fully_shard([model.norm, model.lm_head], mesh=mesh, reshard_after_forward=False)
    else:
        fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # torchtitan: the loss is already over the global token count
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM, which factor 1.0 asks for
    head = model.lm_head
    gathers = []
    original = _fsdp_param_group.foreach_all_gather

    def counting(fsdp_params, *args, **kwargs):
        gathers.append(any(fp._module_info.module is head for fp in fsdp_params))
        return original(fsdp_params, *args, **kwargs)

    batches = _global_batches()
    local_valid = sum((lab != IGNORE_INDEX).sum() for _, lab in batches[rank])
    global_valid = local_valid.clone()
    dist.all_reduce(global_valid)
    loss_fn = FusedLinearCrossEntropyLoss(head)
    per_call, losses = [], []
    _fsdp_param_group.foreach_all_gather = counting
    try:
        for idx, lab in batches[rank]:
            pred = model(idx)
            before = sum(gathers)
            loss, _ = loss_fn(pred, lab, global_valid)
            per_call.append(sum(gathers) - before)
            loss.backward()
            losses.append(loss.detach())
    finally:
        _fsdp_param_group.foreach_all_gather = original
    total = torch.stack(losses).sum()
    dist.all_reduce(total)
    grads = {n: p.grad.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {"per_call": per_call, "loss": total, "grads": grads, "head_sharded": type(head.weight).__name__}


def _fsdp_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        results = {f"grouped={g}": _fsdp_scenario(rank, g) for g in (True, False)}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # every rank's collectives done before any tears its group down (gloo aborts otherwise)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("grouped", [True, False], ids=["norm+head unit", "head alone"])
def test_fsdp2_sharded_head_gradients_match_one_process_float64(tmp_path_factory, grouped):
    out = tmp_path_factory.getbasetemp() / "fsdp2_losses"
    if not (out / "rank1.pt").exists():
        out.mkdir(exist_ok=True)
        spawn(_fsdp_worker, (str(out),), WORLD)
    results = [torch.load(out / f"rank{r}.pt", weights_only=False)[f"grouped={grouped}"] for r in range(WORLD)]
    torch.manual_seed(0)
    model = TinyLM()
    batches = [b for rank_batches in _global_batches() for b in rank_batches]
    ref, ref_loss = _reference_loss(model, batches)
    ref_loss.backward()
    for res in results:
        assert res["head_sharded"] == "DTensor"
        # the head all-gathered at most once per loss call (never in its backward), and exactly once when
        # the model's forward did not leave it unsharded
        assert all(c <= 1 for c in res["per_call"]) and (grouped or res["per_call"] == [1] * MICRO), res["per_call"]
        torch.testing.assert_close(res["loss"].double(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
        for name, q in ref.named_parameters():
            torch.testing.assert_close(res["grads"][name].double(), q.grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{name}: {m}")
