"""Tile sizes for kit/kernels.py (`python -m kit bench tiles`): each kernel of the drafter's one-token step,
for every layer of a Qwen2.5-0.5B shape (random fp16 weights on the GPU), timed per candidate tiling as a
CUDA graph of its 24 launches (weights read cold, as in a real step), then the whole 8-token draft with the
defaults without programmatic dependent launch, with the defaults and with the best tiles. Writes JSON; the best tiles go into kit.kernels.TILES by hand.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.draft_verify import QWEN25_05B, Run, device_time, log, random_stage, wall  # noqa: E402
from kit import kernels  # noqa: E402
from kit.draft import ModelDrafter  # noqa: E402
from kit.graphs import span  # noqa: E402
from kit.model import ModelConfig  # noqa: E402

CANDIDATES = {
    "qkv": {"qkv_pairs": [4, 8, 16], "qkv_warps": [2, 4]},
    "attend": {"attn_slots": [64, 128, 256], "attn_block": [32, 64], "o_rows": [4, 8, 16]},
    "gate_up": {"gate_up_rows": [2, 4, 8, 16], "gate_up_warps": [4, 8]},
    "down": {"down_rows": [1, 2, 4, 8], "down_cols": [1024, 2048, 4096], "down_warps": [4, 8]},
    "head": {"head_rows": [8, 16, 32, 64], "head_warps": [4, 8]},
}


def part_fn(stage, part: str, x, pos, S: int, tiles: dict, vocab: int):
    s = kernels.Scratch(stage, S, tiles, vocab)
    layers = range(len(stage.layers))
    return {
        "qkv": lambda: [kernels.qkv(stage, i, x, pos, s, tiles) for i in layers],
        "attend": lambda: [kernels.attend(stage, i, x, pos, S, s, tiles) for i in layers],
        "gate_up": lambda: [kernels.gate_up(stage, i, x, s, tiles) for i in layers],
        "down": lambda: [kernels.down(stage, i, x, s, tiles) for i in layers],
        "head": lambda: kernels.head(stage, x, s, tiles),
    }[part]


def time_graph(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return device_time(g.replay, reps)["median_ms"] * 1000


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m kit bench tiles", description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=500, help="tokens in the cache; default 500")
    p.add_argument("--reps", type=int, default=30, help="graph replays per candidate; default 30")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kernel_tiles_h200.json",
                   help="JSON result; default bench/results/kernel_tiles_h200.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.set_grad_enabled(False)
    run = Run(args.out, "python -m kit bench tiles " + " ".join(argv), 600)
    cfg = ModelConfig.from_hf(QWEN25_05B)
    stage = random_stage(cfg, 0, cfg.n_layers, device=torch.device("cuda"), seed=1)
    stage.setup_cache(4096)
    assert kernels.available(stage)
    S = span(args.context + 8, 4096)
    x = stage.embed_tokens.weight[7].clone()
    pos = torch.tensor([args.context], device="cuda")
    best, results = dict(kernels.TILES), {}
    for part, grid in CANDIDATES.items():
        rows = []
        for values in itertools.product(*grid.values()):
            tiles = {**best, **dict(zip(grid, values))}
            try:
                us = time_graph(part_fn(stage, part, x, pos, S, tiles, cfg.vocab_size), args.reps)
            except Exception as e:  # a tiling the compiler or the GPU refuses is a result too
                rows.append({**dict(zip(grid, values)), "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            per = us / (1 if part == "head" else cfg.n_layers)
            rows.append({**dict(zip(grid, values)), "us_per_launch": round(per, 2)})
        ok = [r for r in rows if "us_per_launch" in r]
        top = min(ok, key=lambda r: r["us_per_launch"])
        best.update({k: top[k] for k in grid})
        results[part] = {"best": {k: top[k] for k in grid}, "best_us": top["us_per_launch"], "rows": rows}
        log(f"{part}: best {results[part]['best']} {top['us_per_launch']} us "
            f"(default {next((r['us_per_launch'] for r in ok if all(r[k] == kernels.TILES[k] for k in grid)), None)})")
    run.data.update(model="Qwen2.5-0.5B shape, random fp16", context=args.context, attention_span=S,
                    default_tiles=dict(kernels.TILES), best_tiles=best, parts=results)
    g = torch.Generator().manual_seed(0)
    context = torch.randint(0, cfg.vocab_size, (args.context,), generator=g).tolist()
    # the same draft without programmatic dependent launch: what letting kernels overlap is worth
    for name, tiles in (("no_pdl", {**kernels.TILES, "pdl": False}), ("default", dict(kernels.TILES)), ("best", best)):
        kernels.TILES.clear()
        kernels.TILES.update(tiles)
        d = ModelDrafter(stage, cfg.vocab_size, graphs=True, kernels=True)
        tokens = d.propose(context, 8)
        run.data[f"draft8_{name}"] = {"tokens": tokens, **wall(lambda: d.propose(context, 8), 50)}
        log(f"8-token draft, {name} tiles: {run.data[f'draft8_{name}']['median_ms']:.2f} ms {tokens}")
    run.save()
    print(json.dumps(best))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
