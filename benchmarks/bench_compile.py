"""Compile time: Inductor against the comera backend, cold and warm, on the models of bench_e2e.py.

    python benchmarks/bench_compile.py                              # CPU: small sizes, both models
    python benchmarks/bench_compile.py --size full --device cuda    # the GPU: bench_e2e.py's sizes
    python benchmarks/bench_compile.py --model encoder --variants tt-comera --profile

Each measurement is its own process with its own Inductor cache folder (``TORCHINDUCTOR_CACHE_DIR``,
which also holds the FX graph, AOTAutograd and Triton caches, and ``TRITON_CACHE_DIR`` inside it, for the
kernels compiled at their first call): **cold** is a fresh folder, **warm** a second process on the
folder the cold one filled. A process builds the model, compiles it and times
its first training step (forward + backward + ``AdamW.step()``, bf16 autocast as in bench_e2e.py);
compile time is that step minus a steady step (the fastest of three that follow). Variants:

* ``dense-inductor``: ``torch.compile(model)``, the reference;
* ``dense-inductor-cg`` (not in the default list): ``torch.compile(model, mode="reduce-overhead")``,
  Inductor with CUDA graphs (cudagraph trees), which the comera backend turns on for graphs with
  tensor-train layers on the GPU: the reference in the same mode;
* ``dense-comera``: ``backend="comera"`` on the dense model (the cce pass looks at its heads);
* ``tt-comera``: the model tensorized as bench_e2e.py's ``tt`` variant, ``backend="comera"``;
* ``tt-comera-opaque`` (not in the default list): the same with ``options={"tt_merges": "opaque"}`` (every
  layer group's merges as one custom op, which Inductor does not compile; the default ``"auto"`` does
  that for the ``"tt"`` groups, which are all of these models' groups);
* ``tt-comera-opaque-noprecompile`` (not in the default list): the same with ``precompile=False`` (the
  fused loss's kernels compile at their first call, in the first step, not in a side process);
* ``tt-comera-nocg`` (not in the default list): ``tt-comera`` with ``cudagraphs=False`` (the backend turns
  CUDA graphs on for graphs with tensor-train layers on the GPU; how much of the compile that is);
* ``tt-comera-autotune`` (not in the default list): ``tt-comera`` with
  ``inductor_config={"triton.autotune_pointwise": True}`` (Inductor's default, which times several
  configurations of each pointwise kernel at its first call; the backend turns it off for graphs with
  tensor-train layers);
* ``tt-inductor`` (not in the default list): the tensorized model under plain Inductor, whose layers
  each form their dense weight: how much of ``tt-comera``'s time is the tensorized graph itself.

With ``--repeat N`` each repeat measures every variant once, one after the other, so that a drift of
the machine's speed between runs (dense Inductor's own cold compile of one graph moved 17-30 s across
GPU leases, 17.9-29.5 s within one) falls on both sides of a ratio. Reported per variant: cold and
warm compile seconds (medians), the ratio to ``dense-inductor``'s cold time (the median over repeats
of the ratio within a repeat; also to ``dense-inductor-cg``'s where it ran), the backend's own time (our passes, from the ``comera_compile`` logger's records), Dynamo's phase times
(``torch._dynamo.utils.compile_times``: tracing, AOTAutograd, Inductor forward and backward), and the
cache counters of the warm run (FX graph cache and AOTAutograd cache hits, misses and bypasses, with
the bypass reasons). ``--profile`` adds one cold run per variant under cProfile and prints where
the backend's time goes (pass manager, planner, write analysis, fake-tensor propagation, report
building), cumulative seconds per entry point. ``--json`` keeps everything.

Sizes: ``full`` is bench_e2e.py's (the six-encoder MNLI model at d 768 and batch 32 x 128; the
Llama-style LM at d 1024, vocab 128256, 8 x 1024 tokens); ``small`` keeps every layer (the graphs have
the same structure and node counts) at d 256 and a vocabulary of 8192, so a CPU compiles and runs it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = ("dense-inductor", "dense-inductor-cg", "dense-comera", "tt-comera", "tt-comera-opaque",
            "tt-comera-opaque-noprecompile", "tt-comera-nocg", "tt-comera-autotune", "tt-inductor")
DEFAULT_VARIANTS = ("dense-inductor", "dense-comera", "tt-comera")
# Dynamo's phase names (torch._dynamo.utils.compile_times) shown in the table, and their labels.
PHASES = {
    "bytecode_tracing": "dynamo",
    "OutputGraph.call_user_compiler": "backend",
    "aot_trace_joint_graph": "aot trace",
    "min_cut_rematerialization_partition": "partition",
    "compile_fx.<locals>.fw_compiler_base": "inductor fw",
    "compile_fx.<locals>.bw_compiler": "inductor bw",
}
# The backend's entry points whose cumulative time --profile reports: (file suffix, function).
ENTRY_POINTS = (
    ("comera_compile/backend.py", "compile_graph", "backend (passes + inner compiler, forward)"),
    ("comera_compile/backend.py", "compile_inner", "inner compiler (AOTAutograd + Inductor, forward)"),
    ("torch/_inductor/compile_fx.py", "bw_compiler", "Inductor, backward (at the first backward)"),
    ("comera_compile/pass_manager.py", "run_passes", "pass manager"),
    ("comera_compile/pass_manager.py", "_snapshot", "  rollback snapshots"),
    ("passes/tensor_network.py", "tensor_network_pass", "  tensor_network pass"),
    ("passes/cce.py", "cce_pass", "  cce pass"),
    ("comera_compile/tt/planner.py", "plan_linear", "    planner (linear)"),
    ("comera_compile/tt/planner.py", "plan_embedding", "    planner (embedding)"),
    ("comera_compile/matching.py", "writes", "    write analysis (writes)"),
    ("comera_compile/matching.py", "first_write", "    write analysis (first_write)"),
    ("comera_compile/fx_utils.py", "fake_node", "    fake-tensor propagation"),
    ("comera_compile/fx_utils.py", "checked_replace", "    checked replacement"),
    ("comera_compile/cce/planner.py", "decide_fused_loss", "    fused-loss cost rule"),
    ("comera_compile/backend.py", "_readable", "  report building (graph text)"),
    ("comera_compile/cache.py", "source_fingerprint", "  cache key (source hash)"),
    ("kernels/tt_runtime.py", "group_outputs", "group_outputs (fake propagation + AOT's trace)"),
)


# ----------------------------------------------------------------------------- one measurement


def build(model_name: str, size: str):
    """The model and a batch maker, at ``size`` ("full": bench_e2e.py's; "small": every layer, narrower)."""
    import torch

    import bench_e2e

    if size == "full":
        return bench_e2e.build(model_name, smoke=False)
    if model_name == "encoder":
        vocab, batch, seq = 8192, 8, 64
        model = bench_e2e.SixEncoder(vocab=vocab, d=256, layers=6, heads=4, ffn=1024, positions=128)

        def make(device, gen):
            return (torch.randint(0, vocab, (batch, seq), device=device, generator=gen),
                    torch.randint(0, 2, (batch, seq), device=device, generator=gen),
                    torch.randint(0, 3, (batch,), device=device, generator=gen))

        return model, make
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    model = bench_e2e.CausalLMLoss(LlamaForCausalLM(cfg))

    def make(device, gen):
        return (torch.randint(0, cfg.vocab_size, (2, 128), device=device, generator=gen),)

    return model, make


class _BackendRecords(logging.Handler):
    """Keeps the timing records the comera backend logs (``extra={"comera_timing": ...}``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.timings: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        timing = getattr(record, "comera_timing", None)
        if timing is not None:
            self.timings.append(dict(timing))


class _BypassReasons(logging.Handler):
    """Why a cache was bypassed, from torch's own log records."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Bypassing"):
            self.reasons.append(message.splitlines()[0][:300])


def _listen():
    records = _BackendRecords()
    comera = logging.getLogger("comera_compile")
    comera.addHandler(records)
    if comera.getEffectiveLevel() > logging.INFO:
        comera.setLevel(logging.INFO)
    bypass = _BypassReasons()
    for name in ("torch._functorch._aot_autograd.autograd_cache", "torch._inductor.codecache"):
        logger = logging.getLogger(name)
        logger.addHandler(bypass)
        logger.setLevel(logging.DEBUG)
    return records, bypass


def _all_phases() -> dict[str, float]:
    """Every entry of torch._dynamo.utils.compile_times (seconds, summed over graphs)."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv")
    return {name: sum(float(v) for v in str(value).split(",")) for name, value in zip(names, values)}


def _phases() -> dict[str, float]:
    """Dynamo's compile phases (seconds, summed over graphs) for the names in PHASES."""
    return {PHASES[name]: seconds for name, seconds in _all_phases().items() if name in PHASES}


def _counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    keys = {"inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
            "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")}
    out = {k: int(counters[group][k]) for group, names in keys.items() for k in names}
    out["graphs"] = int(counters["stats"]["unique_graphs"])
    from torch._inductor import metrics

    out["kernels"] = int(metrics.generated_kernel_count)
    return out


class _AutotuneWatch:
    """Inductor's first-call timing of each Triton kernel's configurations (GPU only): how many kernels,
    configurations and seconds, by kind (``poi`` pointwise, ``red``/``per`` reductions, ``tem`` templates)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, float]] = []
        try:
            from torch._inductor.runtime.triton_heuristics import CachingAutotuner
        except ImportError:
            return
        original = CachingAutotuner.benchmark_all_configs
        watch = self

        def timed(tuner, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(tuner, *args, **kwargs)
            finally:
                name = getattr(getattr(tuner, "fn", None), "__name__", "?")
                watch.calls.append((name, len(getattr(tuner, "launchers", []) or []), time.perf_counter() - start))

        CachingAutotuner.benchmark_all_configs = timed

    def summary(self) -> dict:
        kinds: dict[str, list[float]] = {}
        for name, configs, seconds in self.calls:
            kind = name.split("_")[1] if name.startswith("triton_") and name.count("_") >= 2 else "other"
            k = kinds.setdefault(kind, [0, 0, 0.0])
            k[0] += 1
            k[1] += configs
            k[2] += seconds
        return {"kernels": len(self.calls), "configs": sum(c for _, c, _ in self.calls),
                "seconds": sum(t for _, _, t in self.calls),
                "by_kind": {k: {"kernels": v[0], "configs": v[1], "seconds": v[2]} for k, v in kinds.items()}}


def run_one(args) -> dict:
    """Build, compile and time one variant in this process (the parent set the cache folder)."""
    import contextlib

    import torch

    import bench_e2e
    # torch.compile(model) with the Inductor backend imports Inductor's compiler when it wraps the model,
    # before the timed step; a registered backend such as comera imports it at its first compile, inside
    # the step. Import it here for every variant, so that the step times compiling, not importing (on
    # the 2-core CPU, 0.8 s of import).
    import torch._inductor.compile_fx  # noqa: F401

    records, bypass = _listen()
    autotune = _AutotuneWatch()
    device = torch.device(args.device)
    torch.manual_seed(0)
    model, make = build(args.model, args.size)
    if args.variant.startswith("tt"):
        bench_e2e.tensorize(model, args.model, "tt")
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    if args.variant == "dense-inductor-cg":  # Inductor with CUDA graphs, as the backend runs tensor-train graphs
        fn = torch.compile(model, mode="reduce-overhead")
    elif args.variant.endswith("inductor"):
        fn = torch.compile(model)
    else:
        import comera_compile  # noqa: F401  (registers the backend in a source checkout)

        options = {}
        if "-opaque" in args.variant:
            options["tt_merges"] = "opaque"
        if args.variant.endswith("-noprecompile"):
            options["precompile"] = False
        if args.variant.endswith("-nocg"):
            options["cudagraphs"] = False
        if args.variant.endswith("-autotune"):
            options["inductor_config"] = {"triton.autotune_pointwise": True}
        fn = torch.compile(model, backend="comera", options=options)
    gen = torch.Generator(device=device).manual_seed(1)
    batches = [make(device, gen) for _ in range(2)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    splits: list[dict[str, float]] = []  # per step: seconds to the forward's return, the backward's, the end

    def step(i: int) -> float:
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = fn(*batches[i % 2])
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        end = time.perf_counter()
        splits.append({"forward_s": forward - start, "backward_s": backward - forward, "rest_s": end - backward})
        return end - start

    profile = None
    if args.cprofile:
        import cProfile

        profile = cProfile.Profile()
    with profile if profile is not None else contextlib.nullcontext():
        first = step(0)
    steady = min(step(i) for i in range(1, 4))
    result = {"model": args.model, "variant": args.variant, "size": args.size, "device": args.device,
              "first_step_s": first, "steady_step_s": steady, "compile_s": first - steady,
              "phases_s": _phases(), "all_phases_s": _all_phases(), "counters": _counters(), "bypass_reasons": sorted(set(bypass.reasons)),
              "backend": records.timings, "torch": torch.__version__,
              "autotune": autotune.summary(), "first_step_split_s": splits[0]}
    if args.variant.split("-")[1] == "comera":  # what our cache key hashes: a warm run after an edit misses
        from comera_compile.cache import source_fingerprint

        result["comera_sources"] = source_fingerprint()
    if profile is not None:
        result["profile"] = _entry_point_times(profile)
        result["profile_top"] = _top_functions(profile)
        if os.environ.get("BENCH_COMPILE_PSTATS"):  # a folder: the raw profile, for pstats' callers/callees
            profile.dump_stats(str(Path(os.environ["BENCH_COMPILE_PSTATS"]) / f"{args.model}-{args.variant}.pstats"))
    return result


def _entry_point_times(profile) -> dict[str, float]:
    """Cumulative seconds of each ENTRY_POINTS function (summed over its definitions)."""
    import pstats

    stats = pstats.Stats(profile).stats
    out = {}
    for suffix, function, label in ENTRY_POINTS:
        total = sum(entry[3] for (path, _, name), entry in stats.items()
                    if name == function and path.replace(os.sep, "/").endswith(suffix))
        out[label] = total
    return out


def _top_functions(profile, count: int = 80) -> list[str]:
    """The ``count`` functions of highest cumulative time, as "seconds  calls  file:line(function)"."""
    import pstats

    stats = pstats.Stats(profile).stats
    rows = sorted(stats.items(), key=lambda kv: kv[1][3], reverse=True)[:count]
    out = []
    for (path, line, name), (_, calls, _, cumulative, _) in rows:
        short = "/".join(Path(path).parts[-3:])
        out.append(f"{cumulative:8.2f} {calls:8d}  {short}:{line}({name})")
    return out


# ----------------------------------------------------------------------------- the driver


def measure(model: str, variant: str, args, cache_dir: str, cprofile: bool = False) -> dict:
    """One process on ``cache_dir``; returns its result (or the error's tail)."""
    out = Path(cache_dir).parent / f"{Path(cache_dir).name}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, __file__, "--one", "--model", model, "--variants", variant, "--size", args.size,
           "--device", args.device, "--out-one", str(out)] + (["--cprofile-one"] if cprofile else [])
    # Triton's own cache too (our kernels compile through it, at their first call): cold means cold
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, TRITON_CACHE_DIR=str(Path(cache_dir) / "triton-jit"))
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    before = _machine_state()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        return {"model": model, "variant": variant, "error": (proc.stdout + proc.stderr)[-3000:]}
    result = json.loads(out.read_text())
    result["machine_before"] = before
    return result


def _python_loop_s() -> float:
    """Seconds for a fixed piece of pure-Python work (the fastest of three): compiling is mostly
    single-threaded Python, so this tracks the speed one core of the machine had as a run began."""
    def work() -> float:
        start = time.perf_counter()
        table: dict = {}
        for i in range(300_000):
            table[i % 1000] = table.get(i % 1000, 0) + i
        return time.perf_counter() - start
    return min(work() for _ in range(3))


def _machine_state() -> dict:
    """What else runs on the machine as a measurement starts (leftover compile workers or kernel jobs of
    the previous process would slow the next one): the load averages, the runnable processes (sampled
    ten times over a second), the other Python processes with their command lines, and the speed of
    one core for pure-Python work (``_python_loop_s``)."""
    state: dict = {"python_loop_s": _python_loop_s()}
    try:
        state["loadavg"] = list(os.getloadavg())
    except OSError:
        pass
    proc = Path("/proc")
    if not (proc / "stat").exists():
        return state
    running = []
    for _ in range(10):
        for line in (proc / "stat").read_text().splitlines():
            if line.startswith("procs_running"):
                running.append(int(line.split()[1]))
        time.sleep(0.1)
    state["procs_running_median"] = statistics.median(running) if running else None
    mine = _ancestors(proc)  # this process and those that started it (a shell whose line names python3)
    others = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if "python" in cmdline:
            others.append(cmdline[:160])
    state["other_python"] = others
    return state


def _ancestors(proc: Path) -> set[int]:
    """This process's id and its ancestors' (read from /proc/<pid>/stat's parent field)."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            stat = (proc / str(pid) / "stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def run_all(args) -> list[dict]:
    """Every variant of a model once per repeat, in turn (dense, tt, dense, tt, ...): the machine's
    speed drifts between runs (dense Inductor's own cold compile of one graph moved 17.9-29.5 s within
    one lease), so the ratio is taken between the runs of one repeat, then the median. With ``--json``
    the results so far are written after each measurement (a job cut by a time limit keeps them)."""
    root = Path(tempfile.mkdtemp(prefix="bench_compile_"))
    results = []
    for model in args.models:
        entries = [{"model": model, "variant": variant, "cold": [], "warm": []} for variant in args.variants]
        results.extend(entries)
        for r in range(args.repeat):
            for entry in entries:
                cache = str(root / f"{model}-{entry['variant']}-{r}")
                entry["cold"].append(measure(model, entry["variant"], args, cache))
                _progress(entry["cold"][-1], f"repeat {r} cold")
                if args.warm:
                    entry["warm"].append(measure(model, entry["variant"], args, cache))
                _save(args, results)
        for entry in entries:
            if args.profile:
                folder = str(root / f"{model}-{entry['variant']}-prof")
                entry["profiled"] = measure(model, entry["variant"], args, folder, cprofile=True)
                _save(args, results)
            print(_row(entry, results), flush=True)
    return results


def _progress(result: dict, label: str) -> None:
    """One line per measurement as it ends: its time and what else ran on the machine when it began."""
    state = result.get("machine_before", {})
    load = state.get("loadavg", [float("nan")])[0]
    print(f"# {result['model']} {result['variant']} {label}: "
          + (f"{result['compile_s']:.1f} s" if "compile_s" in result else "FAILED")
          + f"; before it: load {load:.1f}, runnable {state.get('procs_running_median')}, "
          f"{len(state.get('other_python', []))} other Python processes, "
          f"Python loop {1e3 * state.get('python_loop_s', float('nan')):.0f} ms"
          + _autotune_note(result), flush=True)


def _autotune_note(result: dict) -> str:
    """The first step's split and Inductor's first-call timing of kernel configurations, where recorded."""
    split, tune = result.get("first_step_split_s"), result.get("autotune")
    note = ""
    if split:
        note += "; first step: forward {forward_s:.1f} s, backward {backward_s:.1f} s, rest {rest_s:.1f} s".format(**split)
    if tune and tune["kernels"]:
        note += (f"; configuration timing: {tune['kernels']} kernels, {tune['configs']} configurations, "
                 f"{tune['seconds']:.2f} s (" + ", ".join(f"{k} {v['kernels']}/{v['configs']}/{v['seconds']:.2f} s"
                                                        for k, v in sorted(tune["by_kind"].items())) + ")")
    return note


def _save(args, results: list[dict]) -> None:
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def _paired_ratio(entry: dict, ref: dict) -> float:
    """Median over repeats of this entry's cold compile over the reference's in the same repeat."""
    ratios = [a["compile_s"] / b["compile_s"] for a, b in zip(entry["cold"], ref["cold"])
              if "compile_s" in a and "compile_s" in b and b["compile_s"] > 0]
    return statistics.median(ratios) if ratios else float("nan")


def _median(runs: list[dict], key: str) -> float:
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else float("nan")


def _passes_s(runs: list[dict]) -> float:
    values = [sum(t.get("passes_s", 0.0) for t in r["backend"]) for r in runs if "backend" in r]
    return statistics.median(values) if values else float("nan")


def _entry(results: list[dict], model: str, variant: str) -> dict | None:
    """The results of ``variant`` on ``model``, or None where it did not run."""
    return next((e for e in results if e["model"] == model and e["variant"] == variant), None)


def _row(entry: dict, results: list[dict]) -> str:
    ref = _entry(results, entry["model"], "dense-inductor")
    cold = _median(entry["cold"], "compile_s")
    ratio = _paired_ratio(entry, ref) if ref else float("nan")
    warm = _median(entry["warm"], "compile_s") if entry["warm"] else float("nan")
    errors = [r["error"] for r in entry["cold"] + entry["warm"] if "error" in r]
    if errors:
        return f"{entry['model']:<8} {entry['variant']:<19} FAILED:\n{errors[0]}"
    last = entry["cold"][-1]
    phases = last["phases_s"]
    hits = entry["warm"][-1]["counters"] if entry["warm"] else {}
    cache = (f"fx {hits.get('fxgraph_cache_hit', 0)}/{hits.get('fxgraph_cache_miss', 0)}/"
             f"{hits.get('fxgraph_cache_bypass', 0)} aot {hits.get('autograd_cache_hit', 0)}/"
             f"{hits.get('autograd_cache_miss', 0)}/{hits.get('autograd_cache_bypass', 0)}") if hits else "-"
    nodes = sum(t.get("nodes", 0) for t in last["backend"]) or "-"
    return (f"{entry['model']:<8} {entry['variant']:<19} {cold:8.1f} {ratio:6.2f} {warm:8.1f} "
            f"{_passes_s(entry['cold']):8.2f} {nodes!s:>6} "
            + " ".join(f"{phases.get(label, float('nan')):7.1f}" for label in PHASES.values())
            + f"  {cache}" + _cg_ratio(entry, results))


def _cg_ratio(entry: dict, results: list[dict]) -> str:
    """The ratio to ``dense-inductor-cg`` (Inductor with CUDA graphs), where that variant ran."""
    ref = _entry(results, entry["model"], "dense-inductor-cg")
    if ref is None or ref is entry:
        return ""
    return f"  vs dense-inductor-cg {_paired_ratio(entry, ref):.2f}"


HEADER = (f"{'model':<8} {'variant':<19} {'cold s':>8} {'ratio':>6} {'warm s':>8} {'passes':>8} {'nodes':>6} "
          + " ".join(f"{label[:7]:>7}" for label in PHASES.values()) + "  warm cache hit/miss/bypass")


def report(results: list[dict]) -> None:
    for entry in results:
        sources = {r.get("comera_sources") for r in entry["cold"] + entry["warm"]} - {None}
        if len(sources) > 1:
            print(f"--- {entry['model']} {entry['variant']}: the package's sources changed between the cold and the "
                  "warm run (an edit in the tree): the warm run rightly missed the cache; measure on a quiet tree")
        reasons = sorted({x for r in entry["cold"] + entry["warm"] for x in r.get("bypass_reasons", [])})
        if reasons:
            print(f"--- {entry['model']} {entry['variant']}: cache bypassed: " + " | ".join(reasons))
        prof = entry.get("profiled", {}).get("profile")
        if prof and any(prof.values()):  # dense Inductor runs none of the backend's entry points
            print(f"--- {entry['model']} {entry['variant']}: where the backend's time goes (cProfile, cumulative s)")
            for label, seconds in prof.items():
                print(f"  {label:<50} {seconds:8.3f}")
        top = entry.get("profiled", {}).get("profile_top", [])
        if top:
            print(f"--- {entry['model']} {entry['variant']}: the functions of highest cumulative time (s, calls)")
            for line in top:
                print("  " + line)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["encoder", "llama", "all"], default="all")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    ap.add_argument("--size", choices=["small", "full"], default="small")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--repeat", type=int, default=1,
                    help="cold measurements per variant, the variants in turn (median; ratio: median of paired ratios)")
    ap.add_argument("--no-warm", dest="warm", action="store_false", help="skip the warm measurement")
    ap.add_argument("--profile", action="store_true", help="one more cold run of each variant under cProfile")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out-one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cprofile-one", dest="cprofile", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.variants = args.variants.split(",")
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; valid: {list(VARIANTS)}")
    if args.one:
        args.variant = args.variants[0]
        Path(args.out_one).write_text(json.dumps(run_one(args)))
        return []
    args.models = ["encoder", "llama"] if args.model == "all" else [args.model]
    if "dense-inductor" not in args.variants:  # the reference of the ratio
        args.variants.insert(0, "dense-inductor")
    import torch

    print(f"{args.device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, size {args.size}; compile s = "
          "first training step - steady step; cold s: median; ratio: median over repeats of cold against "
          "dense-inductor's cold of the same repeat (variants run in turn); passes: the comera "
          "backend's passes (cold); phases from torch._dynamo.utils.compile_times (cold)", flush=True)
    print(HEADER, flush=True)
    results = run_all(args)
    report(results)
    _save(args, results)
    return results


if __name__ == "__main__":
    main()
