"""`python -m kit bench NAME ...`: run a benchmark script from bench/ (each writes JSON to bench/results/)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = {
    "relay": ("relay_bench.py", "added latency and throughput of the relay vs a direct socket"),
    "draft": ("draft_verify.py", "8-token draft round of a Qwen2.5-0.5B shape: eager vs CUDA graph (GPU)"),
    "verify": ("draft_verify.py", "9-token verify through a Qwen2.5-7B shape in two stages (GPU)"),
    "tiles": ("kernel_tiles.py", "tile sizes of the drafter's Triton kernels, per kernel, Qwen2.5-0.5B shape (GPU)"),
    "acceptance": ("acceptance.py", "tokens per round of each drafter on SmolLM2-135M, real prompts (CPU)"),
    "e2e": ("e2e.py", "the whole ring: relay, emulated WAN, one process per stage, round-time breakdown"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SCRIPTS:
        print("usage: python -m kit bench {" + ",".join(SCRIPTS) + "} [options]   (NAME --help for its options)\n")
        for name, (_, what) in SCRIPTS.items():
            print(f"  {name:<11} {what}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    name, rest = argv[0], argv[1:]
    path = BENCH / SCRIPTS[name][0]
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH.parent))
    spec.loader.exec_module(module)
    return module.main([name, *rest] if name in ("draft", "verify") else rest)
