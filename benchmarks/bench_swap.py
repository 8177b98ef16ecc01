"""The block tensor-train's regrouping copy ``comera::btt_swap`` (``x [A, M, B, K] -> [B, M, A, K]``) against
``permute(2, 1, 0, 3).contiguous()`` and a plain copy of the same bytes (``clone``: what the memory
allows), bf16, at the shapes of the width sweep's btt layers, on one GPU. ``triton`` is the kernel as
the blocks path runs it (rank > 1: the K elements of a position moved as one wider integer),
``narrow`` the same kernel on the bf16 elements themselves, ``t<N>KiB`` the token-tiled kernel (tiles of about
N KiB spanning several positions; what ``COMERA_BTT_SWAP_TILE=N x 1024`` runs), ``/w<W>`` at W warps.

    python benchmarks/bench_swap.py                 # d 2048 and d 4096 layers, forward and backward swaps
    python benchmarks/bench_swap.py --json out.json
    python benchmarks/bench_swap.py --smoke         # CPU: checks the script (the permute only, no timing)

Each layer ``d_in -> d_out`` at rank ``r`` over ``n`` tokens has its blocks from ``tensorize_``
(``TTConfig(fmt="btt")``: ``d_in = b1 x b2``, ``d_out = c x a``); its forward swaps ``[b1, n, c, r]``, its
backward ``[c, n, b1, r]``. Times: the median of CUDA events around one call, each after an L2 flush and
a GPU spin (``gpu_timing.cuda_time_ms``); ``TB/s``: bytes read and written over the time; ``x copy``:
the time over the plain copy's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import comera_compile as cc  # noqa: E402
from comera_compile.kernels.btt_swap import _swap_triton, swap_blocks  # noqa: E402
from comera_compile.tensorize.parametrization import iter_tt_layers  # noqa: E402

# (d_in, d_out, rank): the width sweep's attention and FFN layers at d 2048 and d 4096 (with the torchtitan
# demo's fused QKV 2048 -> 3072 and FFN 6144), and rank 4
LAYERS = [(2048, 2048, 1), (2048, 3072, 1), (2048, 6144, 1), (6144, 2048, 1), (2048, 5632, 1), (4096, 4096, 1),
          (4096, 11008, 1), (4096, 4096, 4)]
SMOKE_LAYERS = [(64, 96, 1), (64, 64, 2)]
# the token-tiled kernel (COMERA_BTT_SWAP_TILE): tile bytes, num_warps (None: the kernel's own choice, what
# COMERA_BTT_SWAP_TILE runs)
TILED = [(8192, None), (16384, None), (32768, None), (65536, None), (16384, 8), (32768, 4)]


def btt_spec(d_in: int, d_out: int, rank: int):
    """The spec of the btt layer ``tensorize_`` makes of a ``d_in -> d_out`` Linear."""
    model = torch.nn.Sequential(torch.nn.Linear(d_in, d_out))
    cc.tensorize_(model, cc.TTConfig(fmt="btt", rank=rank, min_size=0))
    (layer,) = list(iter_tt_layers(model))
    return layer.spec


def blocks(d_in: int, d_out: int, rank: int) -> tuple[int, int, int]:
    """``(b1, c, r)`` of the btt layer ``tensorize_`` makes of a ``d_in -> d_out`` Linear."""
    spec = btt_spec(d_in, d_out, rank)
    return spec.row_modes[0], spec.col_modes[0], spec.ranks[1]


def totals(rows: list[dict]) -> dict[str, float]:
    """Each variant's time (us) summed over the swaps of ``rows``."""
    total: dict[str, float] = {}
    for row in rows:
        total[row["variant"]] = total.get(row["variant"], 0.0) + row["us"]
    return total


def best_tile(rows: list[dict]) -> int:
    """The tile (bytes) of the token-tiled variant at its own warps (``t<N>KiB``, what
    ``COMERA_BTT_SWAP_TILE=N x 1024`` runs) with the least time over all the swaps of ``rows`` (bench_swap's
    --json; a tile that ran only some of them is left out), if less than the kernel's as it runs now
    (``triton``); else 0."""
    total = totals(rows)
    count: dict[str, int] = {}
    for row in rows:
        count[row["variant"]] = count.get(row["variant"], 0) + 1
    tiled = {k: v for k, v in total.items() if k[:1] == "t" and k.endswith("KiB") and k[1:-3].isdigit()
             and count[k] == count.get("triton")}  # a tile left out of some swaps is no candidate
    if not tiled or "triton" not in total:
        return 0
    name = min(tiled, key=tiled.get)
    return int(name[1:-3]) * 1024 if tiled[name] < total["triton"] else 0


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--best-tile", type=Path, default=None, metavar="JSON",
                    help="print the tile (bytes) of the fastest token-tiled variant in a --json output if it "
                         "beats the kernel as it runs now over all its swaps, else 0; then exit")
    args = ap.parse_args(argv)
    if args.best_tile is not None:
        print(best_tile(json.loads(args.best_tile.read_text())))
        return []
    smoke = args.smoke or not torch.cuda.is_available()
    device = "cpu" if smoke else "cuda"
    n = 16 if smoke else args.tokens
    if not smoke:
        from gpu_timing import cuda_time_ms
    rows = []
    print(f"{torch.cuda.get_device_name() if not smoke else 'cpu (smoke: no timing)'}, torch {torch.__version__}")
    print(f"{'layer':>22} {'swap':>4} {'shape [A, M, B, K]':>22} {'variant':>8} {'us':>8} {'TB/s':>6} {'x copy':>7}")
    for d_in, d_out, rank in SMOKE_LAYERS if smoke else LAYERS:
        b1, c, r = blocks(d_in, d_out, rank)
        for which, shape in (("fwd", (b1, n, c, r)), ("bwd", (c, n, b1, r))):
            x = torch.randn(shape, device=device, dtype=torch.bfloat16)
            want = x.permute(2, 1, 0, 3).contiguous()
            fns = {"permute": lambda: swap_blocks(x, impl="torch"), "copy": lambda: x.clone()}
            if not smoke:
                fns["triton"] = lambda: swap_blocks(x, impl="triton")
                fns["narrow"] = lambda: swap_blocks(x, impl="triton", widen=False)
                for tile, warps in TILED:
                    fns[f"t{tile // 1024}KiB" + (f"/w{warps}" if warps else "")] = (
                        lambda tile=tile, warps=warps: _swap_triton(x, True, tile, warps))
                for name in [k for k in fns if k not in ("permute", "copy")]:
                    try:
                        got = fns[name]()
                    except Exception as err:  # a tile that does not build or launch here: said, left out
                        if name in ("triton", "narrow"):
                            raise
                        print(f"{name}: left out at {list(shape)}: {type(err).__name__}: {err}")
                        del fns[name]
                        continue
                    torch.testing.assert_close(got, want, rtol=0, atol=0)  # a wrong copy stops the benchmark
            torch.testing.assert_close(fns["permute"](), want, rtol=0, atol=0)
            nbytes = 2 * x.numel() * x.element_size()
            times = {k: (float("nan") if smoke else 1e3 * cuda_time_ms(f, args.iters)) for k, f in fns.items()}
            for variant in times:
                us = times[variant]
                row = {"d_in": d_in, "d_out": d_out, "rank": rank, "swap": which, "shape": list(shape),
                       "variant": variant, "us": us, "tb_s": nbytes / us / 1e6 if us == us else None,
                       "x_copy": us / times["copy"] if us == us else None}
                rows.append(row)
                print(f"{f'{d_in} -> {d_out}, r{rank}':>22} {which:>4} {str(list(shape)):>22} {variant:>8} "
                      f"{us:8.1f} {row['tb_s'] or float('nan'):6.2f} {row['x_copy'] or float('nan'):7.2f}")
    if not smoke:  # each variant's time over all the swaps above, against the kernel as it runs now
        total = totals(rows)
        print("all swaps above: " + ", ".join(f"{k} {v:.0f} us ({v / total['triton']:.2f}x)"
                                             for k, v in sorted(total.items(), key=lambda kv: kv[1])))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
