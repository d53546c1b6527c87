"""Where node 0's and the last stage's host time goes, without the network: one process, the ring's
passes back to back (draft -> stage 0 -> pack -> unpack -> stage 1 + verify, Qwen2.5-7B/0.5B shapes,
random weights, compiled stages, 2 GPUs or 1), first with no pause between rounds, then with the
ring's idle 86 ms between them; and each CUDA graph replayed alone, from an idle stream (launch
included) and behind a busy one (launch hidden). Run with KIT_COMPILE unset: the stages compile here.

    python bench/host_gaps.py [--out bench/results/host_gaps_h200.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import e2e
from kit.draft import make_drafter
from kit.graphs import StageRunner
from kit.load import load_stage
from kit.node import from_payload, to_payload
from kit.verify import Sampling, verify


def rounds(parts, prompt: list[int], n: int, idle_s: float) -> dict:
    """Medians (ms) of each part of n rounds, the first 5 left out."""
    drafter, r0, r1, d0, d1 = parts
    ctx = list(prompt)
    r0.stage.rewind(0)
    r1.stage.rewind(0)
    h = r0.stage.step(torch.tensor(ctx[:-1], device=d0), head=False)
    r1.stage.step(h.to(d1), head=False)
    torch.cuda.synchronize(d0)
    torch.cuda.synchronize(d1)
    rows = []
    for _ in range(n):
        time.sleep(idle_s)
        t0 = time.perf_counter()
        drafts = drafter.propose(ctx, 8)
        t1 = time.perf_counter()
        start, tokens = len(ctx) - 1, [ctx[-1], *drafts]
        h = r0(torch.tensor(tokens), start)
        torch.cuda.synchronize(d0)
        t2 = time.perf_counter()
        payload = to_payload(h, {"kind": "round", "start": start, "tokens": tokens})
        t3 = time.perf_counter()
        _, hh = from_payload(bytearray(payload))
        t4 = time.perf_counter()
        accepted, nxt = verify(r1(hh, start)[0], drafts, Sampling(), start + 1)
        t5 = time.perf_counter()
        ctx += drafts[:accepted] + [nxt]
        rows.append({"draft": t1 - t0, "stage0": t2 - t1, "pack": t3 - t2, "unpack": t4 - t3, "stage1_verify": t5 - t4})
    return {k: round(statistics.median(r[k] for r in rows[5:]) * 1000, 3) for k in rows[0]}


def replay_alone(graph: torch.cuda.CUDAGraph, dev: torch.device) -> dict:
    """GPU time of one replay from an idle stream (the launch shows as idle GPU time) and behind a busy
    one (the launch overlaps the busy kernel), and the host time of the replay() call."""
    out = {}
    with torch.cuda.device(dev):
        for mode in ("idle", "busy"):
            host, gpu = [], []
            for _ in range(20):
                torch.cuda.synchronize(dev)
                time.sleep(0.01)
                if mode == "busy":
                    torch.cuda._sleep(3_000_000)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                t = time.perf_counter()
                graph.replay()
                host.append((time.perf_counter() - t) * 1e3)
                e1.record()
                e1.synchronize()
                gpu.append(e0.elapsed_time(e1))
            out[mode] = {"gpu_ms": round(statistics.median(gpu), 3), "host_replay_ms": round(statistics.median(host), 3)}
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python bench/host_gaps.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "host_gaps_h200.json",
                   help="JSON result (default: bench/results/host_gaps_h200.json)")
    p.add_argument("--rounds", type=int, default=30, help="rounds per setting (default: 30)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("python bench/host_gaps.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.set_grad_enabled(False)
    d0 = torch.device("cuda:0")
    d1 = torch.device("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
    work = Path(tempfile.mkdtemp(prefix="kit-gaps-"))
    names = ("qwen2.5-7b", "qwen2.5-0.5b")
    shared = min(e2e.SHAPES[n]["vocab_size"] for n in names)
    pi, pi_d, _ = e2e.planted_maps(0.78, shared)
    target = str(e2e.write_checkpoint(work / names[0], names[0], pi, str(d0), 1))
    draft = str(e2e.write_checkpoint(work / names[1], names[1], pi_d, str(d0), 2))
    half = e2e.SHAPES[names[0]]["num_hidden_layers"] // 2
    s0 = load_stage(target, 0, half, dtype=torch.float16, layer_devices=[str(d0)] * half, progress=False)
    s1 = load_stage(target, half, 2 * half, dtype=torch.float16, layer_devices=[str(d1)] * half, progress=False)
    drafter = make_drafter(draft, target, s0, dtype=torch.float16, device=str(d0), progress=False)
    parts = (drafter, StageRunner(s0, compile=True), StageRunner(s1, compile=True), d0, d1)
    prompt = torch.randint(0, shared, (64,), generator=torch.Generator().manual_seed(5)).tolist()
    rounds(parts, prompt, a.rounds, 0.0)  # captures and compiles
    res = {"busy": rounds(parts, prompt, a.rounds, 0.0), "idle_86ms": rounds(parts, prompt, a.rounds, 0.086)}
    draft_graph = next(v[0] for c in drafter._captured.values() for key, v in c.items() if key[0] == 8)
    res["replay_alone"] = {"draft": replay_alone(draft_graph, d0),
                           "stage0": replay_alone(next(iter(parts[1]._captured.values()))[0], d0),
                           "stage1": replay_alone(next(iter(parts[2]._captured.values()))[0], d1)}
    out = {"command": "python bench/host_gaps.py " + " ".join(argv),
           "hardware": {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                        "cpus": os.cpu_count(), "platform": platform.platform()},
           "versions": {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda},
           "shapes": "Qwen2.5-7B stages [0,14) cuda:0, [14,28) " + str(d1) + ", Qwen2.5-0.5B drafter (Triton), K = 8",
           "ms": res}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
