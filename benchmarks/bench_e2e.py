"""Whole training steps, dense against tensorized, side by side in one run (one GPU).

    python benchmarks/bench_e2e.py                       # every variant of both models
    python benchmarks/bench_e2e.py --model encoder --variants dense-inductor-cg,tt-cg
    python benchmarks/bench_e2e.py --smoke               # CPU: tiny models, a few steps (checks the script)

A step is forward + backward + ``optimizer.step()`` + ``zero_grad(set_to_none=True)``, the loss inside
the compiled region, AdamW with ``fused=True`` (the fast path on CUDA for many small tensors).
Models:

* ``encoder``: CoMERA's six-encoder MNLI transformer (d 768, FFN 3072, 12 heads, vocab 30522, 512
  positions, 2 token types; BERT-style embeddings, post-norm encoder, pooler + 3-class classifier on the
  first token), batch 32 x 128. ``tt``: CoMERA's layout at rank 30 (``fmt="tt"`` Linears, TT-matrix
  embeddings: what ``tensorize_(model, TTConfig(rank=30))`` gave before ``"ttm"`` became the default); ``ttm``: every Linear as a
  TT-matrix at the rank that gives the same parameter count (embeddings as in ``tt``).
* ``lm-d1024``, ``lm-d2048``, ``lm-d4096`` (``--model width``: the width sweep): Llama-style LMs of those
  widths (8, 8 and 4 layers; heads of 128; FFN 8/3 d rounded up to 256; vocabulary 32000), 8 x 1024
  tokens; ``ttm`` / ``tt``: the blocks' Linears at rank 32, ``btt``: as block tensor-trains (blocks near
  the square root) at rank 1 (Monarch), ``btt-r4`` at rank 4; the head and the embedding dense. Each row
  also reports the step's floor at the H200's peak rates (``step_floor``) and the time over it.
* ``llama``: a Llama-style causal LM from a ``transformers`` config (d 1024, 8 layers, 16 heads,
  FFN 4096, vocab 128256), 8 x 1024 tokens, the user's shifted cross-entropy outside the HF model but
  inside the compiled region. ``tt``: every Linear (``fmt="tt"``) and the token embedding (TT-matrix) at rank 32.

Variants (``--variants``, comma-separated): ``dense-eager``, ``dense-inductor``, ``dense-inductor-cg``
(inductor + CUDA graphs, ``mode="reduce-overhead"``), ``dense-comera`` (the cce pass on a dense model),
``tt`` (``backend="comera"`` as it comes: CUDA graphs on for the TT graph), ``tt-nocg`` (CUDA graphs
off), ``tt-fp32``, ``ttm``, ``ttm-nocg``, ``btt`` (width sweep; a tag ``-rN`` sets the rank, e.g.
``btt-r4``). bf16 autocast unless the name says fp32. Tags ``-cg`` /
``-nocg`` force CUDA graphs on / off, ``-cpp`` / ``-combo`` add Inductor's ``cpp_wrapper`` /
``combo_kernels`` (e.g. ``tt-nocg-combo``, ``dense-inductor-cpp``), ``-cce`` fuses the head's loss
whatever the cost rule says (``cce_min_vocab=0``; e.g. ``dense-comera-cce``), ``-opaque`` sets
``tt_merges="opaque"`` (e.g. ``tt-opaque``, ``ttm-opaque``), ``-blocks`` pins btt sites to the blocks path
(``tt_strategy="blocks"``, e.g. ``btt-opaque-blocks``), ``-autotune`` turns Inductor's first-call timing of
pointwise kernels' configurations back on (``triton.autotune_pointwise``, which the backend turns off for
graphs with tensor-train layers; e.g. ``tt-autotune``), ``-viainductor`` runs the same passes inside plain
``torch.compile(model)`` through ``cc.use_with_inductor(options)`` instead of ``backend="comera"`` (e.g.
``btt-viainductor``, to compare with ``btt``).

Each variant runs in its own process: all of them build, compile and warm up concurrently; once every
one is warm they take turns for the timed steps, so no timing overlaps another or a compile. Reported per variant: median step time
(CUDA events), peak memory allocated and reserved (``max_memory_reserved`` includes CUDA-graph pools),
kernels per step and GPU time by kind (profiler; ``--json`` also lists the 15 kernels that take the most), compile time (the warm-up steps minus steady steps),
parameters. The table goes to stdout; ``--json`` keeps everything.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import comera_compile as cc  # noqa: E402

# The width sweep (--model width): Llama-style LMs, vocabulary 32000, 8 x 1024 tokens, Llama's FFN of
# about 8/3 d (a multiple of 256); (layers, heads) per width, so that each fits one H200 with AdamW.
WIDTHS = {1024: (8, 8), 2048: (8, 16), 4096: (4, 32)}
WIDTH_MODELS = [f"lm-d{d}" for d in WIDTHS]
WIDTH_VARIANTS = ["dense-inductor", "dense-inductor-cg", "ttm", "tt", "btt", "btt-r4"]
ALL = {
    "encoder": ["dense-eager", "dense-inductor", "dense-inductor-cg", "tt", "tt-nocg", "tt-fp32", "ttm", "ttm-nocg"],
    "llama": ["dense-inductor", "dense-inductor-cg", "dense-comera", "tt", "tt-nocg"],
    **{m: WIDTH_VARIANTS for m in WIDTH_MODELS},
}
PEAK_FLOPS, PEAK_BYTES = 790e12, 4.3e12  # the H200's bf16 dense rate and its memory bandwidth


def llama_ffn(d: int) -> int:
    """Llama's FFN width, 8/3 of ``d`` rounded up to a multiple of 256."""
    return -(-8 * d // 3 // 256) * 256


# ----------------------------------------------------------------------------- models


class EncoderLayer(nn.Module):
    """Post-norm BERT encoder layer with separate Q/K/V/O projections."""

    def __init__(self, d: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ln1 = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, ffn), nn.Linear(ffn, d)
        self.ln2 = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads

        def split(z):
            return z.view(b, t, h, d // h).transpose(1, 2)

        a = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        x = self.ln1(x + self.o(a.transpose(1, 2).reshape(b, t, d)))
        return self.ln2(x + self.fc2(F.gelu(self.fc1(x))))


class SixEncoder(nn.Module):
    """CoMERA's MNLI model: BERT embeddings, six post-norm encoder layers, pooler, classifier."""

    def __init__(self, vocab=30522, d=768, layers=6, heads=12, ffn=3072, positions=512, classes=3):
        super().__init__()
        self.word = nn.Embedding(vocab, d)
        self.position = nn.Embedding(positions, d)
        self.token_type = nn.Embedding(2, d)
        self.ln = nn.LayerNorm(d)
        self.layers = nn.ModuleList(EncoderLayer(d, heads, ffn) for _ in range(layers))
        self.pooler = nn.Linear(d, d)
        self.classifier = nn.Linear(d, classes)

    def forward(self, ids: torch.Tensor, token_types: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.ln(self.word(ids) + self.position(pos) + self.token_type(token_types))
        for layer in self.layers:
            x = layer(x)
        logits = self.classifier(torch.tanh(self.pooler(x[:, 0])))
        return F.cross_entropy(logits.float(), labels)


class CausalLMLoss(nn.Module):
    """A transformers causal LM with the user's own shifted cross-entropy."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.model = hf_model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=ids).logits
        v = logits.shape[-1]
        return F.cross_entropy(logits[:, :-1].reshape(-1, v).float(), ids[:, 1:].reshape(-1))


def build(model_name: str, smoke: bool) -> tuple[nn.Module, callable]:
    """The model and a function making one (fresh) batch on a device."""
    if model_name == "encoder":
        if smoke:
            model = SixEncoder(vocab=1000, d=64, layers=2, heads=4, ffn=128, positions=64)
            batch, seq, vocab = 4, 16, 1000
        else:
            model = SixEncoder()
            batch, seq, vocab = 32, 128, 30522

        def make(device, gen):
            ids = torch.randint(0, vocab, (batch, seq), device=device, generator=gen)
            types = torch.randint(0, 2, (batch, seq), device=device, generator=gen)
            labels = torch.randint(0, 3, (batch,), device=device, generator=gen)
            return ids, types, labels

        return model, make
    from transformers import LlamaConfig, LlamaForCausalLM

    if model_name in WIDTH_MODELS:
        d = int(model_name[len("lm-d"):])
        layers, heads = WIDTHS[d]
        if smoke:  # the same shape rules at a sixteenth of the width
            d, layers, heads = d // 16, 2, max(1, heads // 8)
        cfg = LlamaConfig(vocab_size=1000 if smoke else 32000, hidden_size=d, intermediate_size=llama_ffn(d),
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                          max_position_embeddings=1024)
        batch, seq = (2, 32) if smoke else (8, 1024)
    elif smoke:
        cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
        batch, seq = 2, 32
    else:
        cfg = LlamaConfig(vocab_size=128256, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                          num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=1024)
        batch, seq = 8, 1024
    cfg._attn_implementation = "sdpa"
    model = CausalLMLoss(LlamaForCausalLM(cfg))

    def make(device, gen):
        return (torch.randint(0, cfg.vocab_size, (batch, seq), device=device, generator=gen),)

    return model, make


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def tensorize(model: nn.Module, model_name: str, fmt: str, rank: int | None = None) -> None:
    if model_name == "encoder":
        rank = 30 if fmt == "tt" else _iso_rank(model)
        if fmt == "tt":  # CoMERA's split: "tt" Linears, TT-matrix embeddings
            cc.tensorize_(model, {"re:.*(word|position|token_type)": cc.TTConfig(rank=30, fmt="ttm"),
                                  "_default": cc.TTConfig(rank=30, fmt="tt")})
        else:  # linears as TT-matrices at equal parameters; embeddings as "tt" r30 does them
            cc.tensorize_(model, {"re:.*(word|position|token_type)": cc.TTConfig(rank=30, fmt="ttm"),
                                  "_default": cc.TTConfig(rank=rank, fmt="ttm")})
        return
    if model_name in WIDTH_MODELS:  # the blocks only: the head and the embedding stay dense
        rank = rank or (1 if fmt == "btt" else 32)
        cc.tensorize_(model, cc.TTConfig(rank=rank, fmt=fmt), filter_fn=lambda module, fqn: ".layers." in fqn)
        return
    cc.tensorize_(model, {"re:.*embed_tokens": cc.TTConfig(rank=32, fmt="ttm"), "_default": cc.TTConfig(rank=32, fmt="tt")})


def step_floor(model: nn.Module, n_tokens: int, seq: int) -> dict:
    """The step's floor at the H200's peak rates: FLOPs (6 x tokens x in x out per dense Linear; per
    tensorized Linear the planner's chosen plan, forward and backward; causal attention at half of
    ``12 x tokens x seq x d`` per layer) and bytes (each parameter read in the forward and the backward,
    its gradient written, AdamW's fp32 update reading and writing the parameter and two moments:
    ~10 fp32 accesses). The larger of the two times is the floor."""
    from comera_compile.tt.planner import plan_btt_linear, plan_linear

    flops, tt_flops = 0, 0
    tt_layers = {lay.fqn: lay for lay in cc.iter_tt_layers(model)}
    for fqn, module in model.named_modules():
        if fqn in tt_layers:
            spec = tt_layers[fqn].param.spec
            plan = (plan_btt_linear if spec.fmt == "btt" else plan_linear)(spec, n_tokens)
            tt_flops += plan.flops
        elif isinstance(module, nn.Linear):
            flops += 6 * n_tokens * module.in_features * module.out_features
    cfg = getattr(getattr(model, "model", None), "config", None)
    if cfg is not None:
        flops += cfg.num_hidden_layers * 6 * n_tokens * seq * cfg.hidden_size  # causal: half of 12 N T d
    total = flops + tt_flops
    nbytes = 10 * 4 * _count(model)
    return {"floor_flops": total, "floor_tt_flops": tt_flops, "floor_bytes": nbytes,
            "floor_ms": 1e3 * max(total / PEAK_FLOPS, nbytes / PEAK_BYTES)}


def _iso_rank(model: nn.Module) -> int:
    """The TT-matrix rank whose model has about as many parameters as ``tt`` r30's."""
    import copy

    ref = copy.deepcopy(model).to("meta")
    cc.tensorize_(ref, {"re:.*(word|position|token_type)": cc.TTConfig(rank=30, fmt="ttm"),
                        "_default": cc.TTConfig(rank=30, fmt="tt")})
    target = _count(ref)
    best = None
    for r in range(4, 65, 2):
        m = copy.deepcopy(model).to("meta")
        cc.tensorize_(m, {"re:.*(word|position|token_type)": cc.TTConfig(rank=30, fmt="ttm"),
                          "_default": cc.TTConfig(rank=r, fmt="ttm")})
        gap = abs(_count(m) - target)
        if best is None or gap < best[0]:
            best = (gap, r)
    return best[1]


# ----------------------------------------------------------------------------- one variant


def _kernel_stats(step, device) -> dict:
    """Kernels per step and GPU time by kind, from the profiler over 3 steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize(device)
    kinds = {"gemm": 0.0, "inductor": 0.0, "adam": 0.0, "other": 0.0}
    by_name: dict[str, list[float]] = {}  # kernel name -> [GPU microseconds, launches] over the 3 steps
    count = 0
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = evt.name.lower()
        if name.startswith(("memcpy", "memset")):
            continue
        count += 1
        t = evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
        entry = by_name.setdefault(evt.name[:120], [0.0, 0])
        entry[0] += t
        entry[1] += 1
        if any(k in name for k in ("gemm", "cutlass", "xmma", "cublas", "sm90_", "sm80_")):
            kinds["gemm"] += t
        elif name.startswith("triton"):
            kinds["inductor"] += t
        elif "adam" in name or "multi_tensor" in name:
            kinds["adam"] += t
        else:
            kinds["other"] += t
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:15]  # where the step's GPU time goes
    return {"kernels_per_step": count / 3, **{f"gpu_ms_{k}": v / 3e3 for k, v in kinds.items()},
            "top_kernels": [{"name": n, "ms": t / 3e3, "per_step": c / 3} for n, (t, c) in top]}


def run_variant(model_name: str, variant: str, args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    torch.manual_seed(0)
    model, make = build(model_name, args.smoke)
    dense_params = _count(model)
    fmt = next(f for f in ("ttm", "btt", "tt") if variant.startswith(f) or f == "tt")
    tags = set(variant.split("-"))
    ranks = [int(t[1:]) for t in tags if t[:1] == "r" and t[1:].isdigit()]
    if not variant.startswith("dense"):
        tensorize(model, model_name, fmt, ranks[0] if ranks else None)
    model = model.to(device)
    params = _count(model)
    fp32, cg, nocg = "fp32" in tags, "cg" in tags, "nocg" in tags
    inductor = {k: True for k, tag in (("cpp_wrapper", "cpp"), ("combo_kernels", "combo"),
                                       ("triton.autotune_pointwise", "autotune")) if tag in tags}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    if variant == "dense-eager":
        fn = model
    elif variant.startswith("dense-inductor"):
        options = {"triton.cudagraphs": cg, **inductor} if inductor else None
        fn = torch.compile(model, mode=None if options else "reduce-overhead" if cg else None, options=options)
    else:
        options = {"inner": "aot_eager"} if args.smoke else {}
        if inductor:
            options["inductor_config"] = inductor
        if cg or nocg:
            options["cudagraphs"] = cg
        if "cce" in tags:  # the head's loss fused whatever the cost rule says
            options["cce_min_vocab"] = 0
        if "opaque" in tags:  # the TT layer groups' merges as one custom op each
            options["tt_merges"] = "opaque"
        if "blocks" in tags:  # btt sites on the blocks path whatever the planner's estimate
            options["tt_strategy"] = "blocks"
        if "viainductor" in tags:  # the same passes inside plain torch.compile (Inductor's pre-grad pass)
            options.pop("inner", None)
            cc.use_with_inductor(options or None)
            fn = torch.compile(model)
        else:
            fn = torch.compile(model, backend="comera", options=options or None)
    gen = torch.Generator(device=device).manual_seed(1)
    batches = [make(device, gen) for _ in range(4)]
    floor = step_floor(model, batches[0][0].numel(), batches[0][0].shape[-1])
    autocast = contextlib.nullcontext() if fp32 else torch.autocast(device.type, dtype=torch.bfloat16)
    it = [0]

    def step():
        batch = batches[it[0] % len(batches)]
        it[0] += 1
        with autocast:
            loss = fn(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    t0 = time.perf_counter()
    warm = []
    for _ in range(args.warmup):
        s = time.perf_counter()
        loss = step()
        sync()
        warm.append(time.perf_counter() - s)
    first_loss = float(loss)
    _wait_turn(args)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(args.steps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            loss = step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        stats = _kernel_stats(step, device)
        if args.cprofile:
            _host_profile(step, args.cprofile, variant)
        peak_alloc = torch.cuda.max_memory_allocated(device) / 2**20
        peak_res = torch.cuda.max_memory_reserved(device) / 2**20
    else:
        times = []
        for _ in range(args.steps):
            s = time.perf_counter()
            loss = step()
            times.append(1e3 * (time.perf_counter() - s))
        stats, peak_alloc, peak_res = {}, float("nan"), float("nan")
    _done_turn(args)
    times.sort()
    median = times[len(times) // 2]
    compile_s = sum(warm) - len(warm) * median / 1e3
    return {"model": model_name, "variant": variant, "step_ms": median, "step_ms_min": times[0],
            "peak_alloc_mib": peak_alloc, "peak_reserved_mib": peak_res, "compile_s": compile_s,
            "first_loss": first_loss, "last_loss": float(loss), "params": params, "dense_params": dense_params,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "wall_s": time.perf_counter() - t0, **floor, **stats}


def _host_profile(step, n: int, variant: str) -> None:
    """Where the host's time goes (cProfile over ``n`` steps): top functions by own time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    prof.disable()
    print(f"--- host profile of {variant}, {n} steps", flush=True)
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    pstats.Stats(prof).sort_stats("cumtime").print_stats(25)


# ----------------------------------------------------------------------------- turn-taking


def _wait_turn(args) -> None:
    """Block until the file ``args.turn`` holds this variant's index (the driver's turn order)."""
    if not args.turn:
        return
    Path(args.turn + f".ready{args.index}").touch()
    while int(Path(args.turn).read_text() or -1) != args.index:
        time.sleep(0.2)


def _write_turn(path: str, value: int) -> None:
    """Atomically (a reader never sees a half-written file)."""
    Path(path + ".tmp").write_text(str(value))
    os.replace(path + ".tmp", path)


def _done_turn(args) -> None:
    if args.turn:
        _write_turn(args.turn, args.index + 1)


def drive(jobs: list[tuple[str, str]], args) -> list[dict]:
    """Run every (model, variant) in its own process: concurrent compiles, timings one at a time."""
    tmp = tempfile.mkdtemp(prefix="bench_e2e_")
    turn = os.path.join(tmp, "turn")
    _write_turn(turn, -1)
    procs = []
    for i, (model_name, variant) in enumerate(jobs):
        out = os.path.join(tmp, f"{i}.json")
        cmd = [sys.executable, __file__, "--model", model_name, "--variants", variant, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--turn", turn, "--index", str(i), "--out-one", out]
        if args.smoke:
            cmd.append("--smoke")
        if args.cprofile:
            cmd += ["--cprofile", str(args.cprofile)]
        log = open(os.path.join(tmp, f"{i}.log"), "w")
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), out, log.name, variant))
    # every variant compiles and warms up first (compiling takes every CPU core, which would slow a
    # host-bound timing); then the turns go in order; a variant that died is skipped
    for i, (p, out, logname, variant) in enumerate(procs):
        while not Path(turn + f".ready{i}").exists() and p.poll() is None:
            time.sleep(0.5)
    for i, (p, out, logname, variant) in enumerate(procs):
        _write_turn(turn, i)
        while int(Path(turn).read_text()) == i and p.poll() is None:
            time.sleep(0.2)
    results = []
    for p, out, logname, variant in procs:
        p.wait()
        if args.logs:
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            Path(args.logs, f"{variant}.log").write_text(Path(logname).read_text())
        if os.path.exists(out):
            results.append(json.loads(Path(out).read_text()))
        else:
            tail = Path(logname).read_text()[-3000:]
            print(f"--- {variant} failed:\n{tail}", flush=True)
    return results


def table(results: list[dict]) -> str:
    head = (f"{'model':<8} {'variant':<18} {'step ms':>8} {'vs dense':>8} {'x floor':>7} {'alloc MiB':>9} {'resv MiB':>9} "
            f"{'kernels':>8} {'gemm ms':>8} {'ind ms':>7} {'other ms':>8} {'adam ms':>7} {'compile s':>9} {'params':>11}")
    lines = [head]
    for r in results:
        graphs = "cg" in r["variant"].split("-") or (not r["variant"].startswith("dense") and "nocg" not in
                                                    r["variant"].split("-"))
        ref = next((x for x in results if x["model"] == r["model"] and x["variant"] == (
            "dense-inductor-cg" if graphs else "dense-inductor")), None)
        vs = r["step_ms"] / ref["step_ms"] if ref else float("nan")
        over = r["step_ms"] / r["floor_ms"] if r.get("floor_ms") else float("nan")
        lines.append(f"{r['model']:<8} {r['variant']:<18} {r['step_ms']:8.2f} {vs:8.2f} {over:7.1f} {r['peak_alloc_mib']:9.0f} "
                     f"{r['peak_reserved_mib']:9.0f} {r.get('kernels_per_step', float('nan')):8.0f} "
                     f"{r.get('gpu_ms_gemm', float('nan')):8.2f} {r.get('gpu_ms_inductor', float('nan')):7.2f} "
                     f"{r.get('gpu_ms_other', float('nan')):8.2f} {r.get('gpu_ms_adam', float('nan')):7.2f} "
                     f"{r['compile_s']:9.1f} {r['params']:11,}")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["encoder", "llama", "all", "width"] + WIDTH_MODELS, default="all",
                    help="width: the width sweep (" + ", ".join(WIDTH_MODELS) + ")")
    ap.add_argument("--variants", default=None,
                    help="comma-separated (default: all of the model's); MODEL:VARIANT names one model's")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny models, inner aot_eager: checks the script")
    ap.add_argument("--serial", action="store_true", help="run the variants one after another in this process")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cprofile", type=int, default=0, metavar="STEPS",
                    help="also print a host-side cProfile of STEPS steps per variant (in its log)")
    ap.add_argument("--logs", default=None, help="keep each variant's log in this folder")
    ap.add_argument("--turn", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out-one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.out_one:
        (variant,) = args.variants.split(",")
        Path(args.out_one).write_text(json.dumps(run_variant(args.model, variant, args)))
        return []
    models = {"all": ["encoder", "llama"], "width": WIDTH_MODELS}.get(args.model, [args.model])
    jobs = [(m, v) for m in models for v in (args.variants.split(",") if args.variants else ALL[m])]
    jobs = [(v.split(":")[0], v.split(":")[1]) if ":" in v else (m, v) for m, v in jobs]  # "llama:tt"
    jobs = [j for j in dict.fromkeys(jobs) if j[0] in models]
    for _, v in jobs:
        base = next((b for b in ("dense-eager", "dense-inductor", "dense-comera", "ttm", "btt", "tt") if v.startswith(b)),
                    None)
        tags = set(v[len(base):].split("-")) - {""} if base else set()
        ranks = {t for t in tags if t[:1] == "r" and t[1:].isdigit() and int(t[1:]) > 0}
        known = {"cg", "nocg", "fp32", "cpp", "combo", "cce", "opaque", "blocks", "autotune", "viainductor"}
        if base is None or tags - ranks - known or (ranks and base.startswith("dense")) or \
                ("viainductor" in tags and base in ("dense-eager", "dense-inductor")):
            ap.error(f"unknown variant {v!r}: dense-eager, dense-inductor, dense-comera, tt, ttm or btt, "
                     "then any of the tags -cg, -nocg, -fp32, -cpp, -combo, -cce, -opaque, -blocks, -autotune, "
                     "-viainductor (not for dense-eager / dense-inductor), -rN (a rank; not for dense)")
    if args.serial:
        results = [run_variant(m, v, args) for m, v in jobs]
    else:
        results = drive(jobs, args)
    print(f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}; median of {args.steps} steps; 'vs dense': against dense inductor in the same "
          "mode (CUDA graphs or not)")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
