"""NF4 linear layers of a Qwen2.5-14B shape for a round's few tokens (`python -m kit bench nf4`): kit.nf4's
Triton kernel against bitsandbytes, beside the floor of the bytes they must read.

Four decoder layers' seven linear maps (random weights quantised to NF4 by bitsandbytes on the GPU; 550 MB,
well past the L2 cache, so weights are read cold as in a stage pass) are multiplied by T = 1, 9 and 16 tokens,
each way captured as one CUDA graph. First the kernel's tiles are tried per weight shape at T = 9 (the best
go into kit.nf4.tiles by hand): (BLOCK_N, SUB, warps, stages) as kit.nf4.matmul takes them. Writes JSON with the command, GPU and versions.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.draft_verify import Run, copy_bandwidth, device_time, log  # noqa: E402
from kit import nf4  # noqa: E402
from kit.plan import nf4_bytes  # noqa: E402

HIDDEN, INTER, KV = 5120, 13824, 1024  # Qwen2.5-14B: 40 query heads and 8 kv heads of 128
SHAPES = {"q": (HIDDEN, HIDDEN), "k": (KV, HIDDEN), "v": (KV, HIDDEN), "o": (HIDDEN, HIDDEN),
          "gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}  # (out, in)
BIAS = {"q", "k", "v"}
# first the tile's shape at 4 warps and 2 stages; then warps and stages for the best
SHAPE_CANDIDATES = {"block_n": [16, 32, 64, 128], "sub": [1, 2, 4]}
LAUNCH_CANDIDATES = {"warps": [2, 4, 8], "stages": [1, 2]}


def nf4_layer(n: int, k: int, bias: bool, gen: torch.Generator):
    import bitsandbytes as bnb

    q = bnb.nn.Linear4bit(k, n, bias=bias, compute_dtype=torch.float16, quant_type="nf4", device="meta")
    w = torch.empty(n, k, dtype=torch.float16, device="cuda").normal_(0, 0.02, generator=gen)
    q.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4")
    if bias:
        q.bias = torch.nn.Parameter(torch.empty(n, dtype=torch.float16, device="cuda").normal_(0, 0.02, generator=gen),
                                    requires_grad=False)
    return q.cuda()


def graph_us(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return device_time(g.replay, reps)["median_ms"] * 1000


def try_tile(tile: tuple, *, rows: list, shape: tuple[int, int], names: list[str], pass_fn, args) -> None:
    """Time the kernel with `tile` on the matrices `names` (all of `shape`) at T = 9; append the result to rows."""
    if shape[1] % (64 * tile[1]):
        return
    try:
        us = graph_us(pass_fn(9, lambda x, q: nf4.matmul(x, q, tile), names), args.reps)
    except Exception as e:  # a tiling the compiler refuses is a result too
        rows.append({"tile": tile, "error": f"{type(e).__name__}: {e}"[:200]})
        return
    rows.append({"tile": tile, "us_per_matrix": round(us / len(names) / args.layers, 2)})


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m kit bench nf4", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4, help="decoder layers' worth of weights; default 4")
    p.add_argument("--reps", type=int, default=30, help="graph replays per timing; default 30")
    p.add_argument("--no-tiles", action="store_true", help="skip trying tiles; time the defaults only")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "nf4_h200.json",
                   help="JSON result; default bench/results/nf4_h200.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA GPU (and bitsandbytes)", file=sys.stderr)
        return 2
    import bitsandbytes as bnb

    torch.set_grad_enabled(False)
    run = Run(args.out, "python -m kit bench nf4 " + " ".join(argv), 600)
    run.data.update(model="Qwen2.5-14B linear shapes, random weights in NF4", layers=args.layers,
                    bitsandbytes=bnb.__version__)
    run.data["copy_bandwidth"] = bw = copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [{name: nf4_layer(n, k, name in BIAS, gen) for name, (n, k) in SHAPES.items()} for _ in range(args.layers)]
    xs = {T: {k: torch.randn(1, T, k, device="cuda", dtype=torch.float16) for k in (HIDDEN, INTER)} for T in (1, 9, 16)}

    def pass_fn(T: int, how, names=tuple(SHAPES)):
        return lambda: [how(xs[T][SHAPES[n][1]], layer[n]) for layer in layers for n in names]

    # what the kernel gives vs bitsandbytes' dequantised weight, fp16 as a stage runs it
    err = 0.0
    for name, q in layers[0].items():
        w = bnb.functional.dequantize_4bit(q.weight.data, q.weight.quant_state)
        x = xs[9][SHAPES[name][1]]
        want = torch.nn.functional.linear(x, w, q.bias).float()
        err = max(err, ((nf4.matmul(x, q).float() - want).abs().max() / want.abs().max()).item())
    run.data["max_rel_diff_vs_dequantised"] = err
    log(f"kernel vs dequantised weight: max |diff| / max |y| = {err:.2e}")

    groups = {}
    for name, shape in SHAPES.items():
        groups.setdefault(shape, []).append(name)
    if not args.no_tiles:
        tried = {}
        for shape, names in groups.items():
            rows = []
            attempt = functools.partial(try_tile, rows=rows, shape=shape, names=names, pass_fn=pass_fn, args=args)
            for block_n, sub in itertools.product(*SHAPE_CANDIDATES.values()):
                attempt((block_n, sub, 4, 2))
            block_n, sub, _, _ = min((r for r in rows if "us_per_matrix" in r), key=lambda r: r["us_per_matrix"])["tile"]
            for warps, stages in itertools.product(*LAUNCH_CANDIDATES.values()):
                if (warps, stages) != (4, 2):
                    attempt((block_n, sub, warps, stages))
            ok = [r for r in rows if "us_per_matrix" in r]
            best = min(ok, key=lambda r: r["us_per_matrix"])
            default = nf4.tiles(*shape, torch.device("cuda"))
            tried[f"{shape[0]}x{shape[1]}"] = {"default": default, "best": best, "rows": rows}
            log(f"{shape}: best {best}, default {default} "
                f"{next((r['us_per_matrix'] for r in ok if tuple(r['tile']) == default), None)} us "
                f"(floor {nf4_bytes(shape[0] * shape[1]) / bw['gb_per_s'] / 1e3:.1f} us)")
            run.data["tiles"] = tried
            run.save()
        run.data["tiles"] = tried
        run.save()

    floor_bytes = args.layers * sum(nf4_bytes(n * k) for n, k in SHAPES.values())
    floor_us = floor_bytes / bw["gb_per_s"] / 1e3
    run.data["floor"] = {"bytes": floor_bytes, "us": floor_us}
    timings = {}
    for T in (1, 9, 16):
        ours = graph_us(pass_fn(T, nf4.matmul), args.reps)
        theirs = graph_us(pass_fn(T, lambda x, q: q(x)), args.reps)
        timings[T] = {"kernel_us_per_layer": ours / args.layers, "bitsandbytes_us_per_layer": theirs / args.layers,
                      "kernel_over_floor": ours / floor_us, "bitsandbytes_over_floor": theirs / floor_us,
                      "speedup": theirs / ours}
        log(f"T={T:>2}: kernel {ours / args.layers:7.1f} us a layer ({ours / floor_us:.2f}x floor), bitsandbytes "
            f"{theirs / args.layers:7.1f} us ({theirs / floor_us:.2f}x); floor {floor_us / args.layers:.1f} us a layer")
    run.data["per_layer"] = timings
    run.save()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
