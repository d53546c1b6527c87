"""GPU cost of one speculative round's compute (`python -m kit bench draft|verify`).

draft:  an 8-token greedy draft round of a Qwen2.5-0.5B-shaped drafter (`ModelDrafter.propose`).
verify: 9 tokens through a Qwen2.5-7B-shaped target cut in two stages on one GPU (`StageRunner`).

Each is timed eager, as a CUDA graph, as a CUDA graph over joined projections, and as a CUDA graph of
torch.compile'd code, beside its memory-bandwidth floor (weight bytes over the copy bandwidth measured
in the same run) and beside `transformers` eager on the same weights. Weights are random fp16 (time
does not depend on their values), built on the GPU from the published config shapes: nothing is
downloaded. Graph outputs are checked against eager: identical draft tokens, close verify logits.
"""
from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/draft_verify.py`
    sys.path.insert(0, str(ROOT))

from kit.draft import ModelDrafter  # noqa: E402
from kit.graphs import StageRunner, span  # noqa: E402
from kit.load import set_param  # noqa: E402
from kit.model import ModelConfig, Stage  # noqa: E402

QWEN25_05B = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True)
QWEN25_7B = dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                 num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                 max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=False)
TARGETS_MS = {"draft": 6.0, "verify": 5.5}
RESULT = ROOT / "bench" / "results" / "draft_verify_h200.json"


def random_stage(cfg: ModelConfig, start: int, end: int, *, device: torch.device, seed: int,
                 dtype: torch.dtype = torch.float16) -> Stage:
    """Stage [start, end) with random weights made on `device`: N(0, 0.02) matrices and biases, norms
    near 1; the final norm is 4 so the head's argmax wins by margins above fp16 rounding."""
    first, last = start == 0, end == cfg.n_layers
    with torch.device("meta"):
        stage = Stage(cfg, start, end, first=first, last=last)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in list(stage.named_parameters()):
        if name == "lm_head.weight" and cfg.tie_embeddings and first:
            continue
        t = torch.empty(p.shape, dtype=dtype, device=device)
        if name == "norm.weight":
            t.fill_(4.0)
        elif "norm" in name:
            t.normal_(1.0, 0.02, generator=gen)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        set_param(stage, name, t)
    if last and cfg.tie_embeddings and first:
        set_param(stage, "lm_head.weight", stage.embed_tokens.weight.data)
    return stage.eval().requires_grad_(False)


def hf_twin(hf_config: dict, stages: list[Stage]):
    """The `transformers` model of the same config holding the stages' weights (a copy)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(hf_config)
    conf = AutoConfig.for_model(spec.pop("model_type"), **spec)
    dev, dtype = stages[0].device, stages[0].dtype
    with torch.device(dev):
        hf = AutoModelForCausalLM.from_config(conf, dtype=dtype)
    ours = {}
    for s in stages:
        for name, p in s.named_parameters():
            if name.startswith("layers."):
                i = int(name.split(".")[1])
                ours[f"model.layers.{s.start + i}." + name.split(".", 2)[2]] = p
            elif name == "lm_head.weight":
                ours[name] = p
            else:
                ours["model." + name] = p
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(ours[name])
    return hf.eval().requires_grad_(False)


def hf_cache_kw(hf) -> str:
    """The forward keyword for the KV cache (`cache` in newer transformers, `past_key_values` before)."""
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def crop(cache, n: int) -> None:
    """Cut a `transformers` DynamicCache back to n tokens (a negative count removes, in every 4.x/5.x)."""
    extra = cache.get_seq_length() - n
    if extra > 0:
        cache.crop(-extra)


def summary(ms: list[float]) -> dict:
    ms = sorted(ms)
    q = statistics.quantiles(ms, n=10) if len(ms) >= 10 else [ms[0]] * 9
    return {"median_ms": statistics.median(ms), "p10_ms": q[0], "p90_ms": q[-1], "min_ms": ms[0], "n": len(ms)}


BONUS = 7  # any id: greedy drafts after it are compared between variants


def wall(fn, reps: int, warmup: int = 3) -> dict:
    """Host wall time per call, synchronised before and after each call (what a caller waits)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ms = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ms.append((time.perf_counter() - t0) * 1e3)
    return summary(ms)


def device_time(fn, reps: int, warmup: int = 3) -> dict:
    """GPU time per call between CUDA events (excludes host work before the first launch)."""
    for _ in range(warmup):
        fn()
    ms = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    return summary(ms)


def copy_bandwidth(gib: float = 2.0) -> dict:
    """Device-to-device copy rate, bytes read plus bytes written, on random data."""
    n = int(gib * 2**30) // 2
    a = torch.empty(n, dtype=torch.float16, device="cuda").normal_()
    b = torch.empty_like(a)
    t = device_time(lambda: b.copy_(a), 20)
    del a, b
    return {"bytes_moved": 4 * n, "median_ms": t["median_ms"], "gb_per_s": 4 * n / t["median_ms"] / 1e6}


def weight_bytes(stages: list[Stage]) -> int:
    """Bytes a pass reads from the weights: all but the embedding table (one row per token)."""
    seen, total = set(), 0
    for s in stages:
        for name, p in s.named_parameters():
            if name.startswith("embed_tokens") or p.data_ptr() in seen:
                continue
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def kv_bytes(cfg: ModelConfig, n_layers: int, length: int, dtype_bytes: int = 2) -> int:
    return 2 * n_layers * cfg.n_kv_heads * cfg.head_dim * length * dtype_bytes


def kernel_profile(fn, reps: int = 5, top: int = 12) -> dict:
    """Kernels per call and where the GPU time goes, from the profiler (CUDA graph replays included)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = e.cuda_time_total
        if us > 0:
            rows.append((e.key, us / reps, e.count / reps))
    rows.sort(key=lambda r: -r[1])
    kernels = sum(c for _, _, c in rows)
    return {"kernels_per_call": kernels, "gpu_us_per_call": sum(u for _, u, _ in rows),
            "top": [{"name": k[:120], "us": round(u, 1), "count": c} for k, u, c in rows[:top]]}


class Run:
    """Results written to JSON after every step, so a cut-short run still leaves its numbers."""

    def __init__(self, path: Path, command: str, budget_s: float):
        self.path, self.t0, self.budget_s = path, time.perf_counter(), budget_s
        import transformers

        p = torch.cuda.get_device_properties(0)
        self.data = {"command": command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                     "gpu": torch.cuda.get_device_name(0), "sms": p.multi_processor_count,
                     "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
                     "python": platform.python_version(), "targets_ms": TARGETS_MS}

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1))


def log(*a) -> None:
    print(*a, flush=True)


def variants(args) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """(name, runner options), standard ones then extra compile modes (timed after transformers).
    Joining projections is one-way, so the plain graph comes before the joined ones."""
    standard = [("eager", dict(graphs=False))]
    if not args.compiled_only:
        standard += [("graph", dict(graphs=True, compile=False)),
                     ("graph_fused", dict(graphs=True, compile=False, fuse=True))]
    extra = []
    for m in args.compile:
        name = "graph_compiled" if m == "default" else f"graph_compiled_{m}"
        (standard if m == "default" else extra).append((name, dict(graphs=True, compile=m, fuse=True)))
    return standard, extra


def draft_variants(args) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """The drafter's variants: the verify ones with our Triton kernels off, then with them (the default)."""
    standard, extra = variants(args)
    off = lambda vs: [(n, {**o, "kernels": False}) for n, o in vs]  # noqa: E731
    return off(standard) + [("graph_triton", dict(graphs=True, kernels=True))], off(extra)


def bench_draft(args, run: Run) -> None:
    dev = torch.device("cuda")
    cfg = ModelConfig.from_hf(QWEN25_05B)
    stage = random_stage(cfg, 0, cfg.n_layers, device=dev, seed=1)
    stage.setup_cache(args.max_len)
    k, vocab = args.k, cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (args.context,), generator=g).tolist()
    longer = context + torch.randint(0, vocab, (args.long_context - args.context,), generator=g).tolist()
    wbytes = weight_bytes([stage])
    bw = run.data["copy_bandwidth"]["gb_per_s"]
    res = run.data["draft"] = {
        "model": "Qwen2.5-0.5B shape, random fp16", "k": k, "context": args.context, "max_len": args.max_len,
        "attention_span": span(args.context - 1 + k, args.max_len),
        "weight_bytes_per_token": wbytes, "kv_bytes_per_token": kv_bytes(cfg, cfg.n_layers, args.context),
        "floor_ms": k * wbytes / bw / 1e6, "target_ms": TARGETS_MS["draft"], "variants": {}}
    log(f"draft: {wbytes / 1e6:.0f} MB weights/token, floor {res['floor_ms']:.2f} ms for {k} tokens")
    ref = {}

    def one(name: str, opt: dict) -> None:
        if run.left() < 60:
            res["variants"][name] = {"skipped": "time budget"}
            return
        if opt.pop("fuse", False):
            stage.fuse()
        d = ModelDrafter(stage, vocab, **opt)
        t0 = time.perf_counter()
        try:
            tokens = d.propose(context, k)
        except Exception as e:  # a compile failure is a result too
            res["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            log(f"  {name}: FAILED {e}")
            return
        setup_s = time.perf_counter() - t0
        accepted = context + tokens + [BONUS]  # all k accepted plus the target's bonus token: the cache
        nxt = d.propose(accepted, k)  # lacks the last draft, which goes through the graph before the loop
        ref.setdefault("tokens", tokens)
        ref.setdefault("next", nxt)
        t = wall(lambda: d.propose(context, k), args.rounds)
        v = {"setup_s": round(setup_s, 2), "tokens": tokens, "tokens_equal_eager": tokens == ref["tokens"],
             "next_round_equal_eager": nxt == ref["next"], **t, "x_floor": t["median_ms"] / res["floor_ms"]}
        if tokens != ref["tokens"]:
            v["first_mismatch"] = mismatch(stage, context, ref["tokens"], tokens)
        if d.graphs:
            graph = d._captured[0][k, span(len(context) - 1 + k, args.max_len)][0]
            v["two_rounds_second_fully_accepted"] = wall(lambda: (d.propose(context, k), d.propose(accepted, k)),
                                                         args.rounds)
            v["replay"] = device_time(graph.replay, args.rounds)
            if args.profile and name != "graph_fused":
                v["profile"] = kernel_profile(graph.replay)
            d.propose(longer, k)
            v["long_context"] = {"context": len(longer), "attention_span": span(len(longer) - 1 + k, args.max_len),
                                 **wall(lambda: d.propose(longer, k), args.rounds)}
        res["variants"][name] = v
        log(f"  {name}: {t['median_ms']:.2f} ms (setup {setup_s:.1f} s) tokens equal eager: {tokens == ref['tokens']}"
            + (f"; {v['long_context']['median_ms']:.2f} ms at {len(longer)} tokens" if "long_context" in v else ""))

    standard, extra = draft_variants(args)
    for name, opt in standard:
        one(name, opt)
        run.save()

    if args.transformers and run.left() > 60:
        hf = hf_twin(QWEN25_05B, [stage])
        kw = hf_cache_kw(hf)
        from transformers import DynamicCache

        cache = DynamicCache()
        hf(input_ids=torch.tensor([context[:-1]], device=dev), use_cache=True, logits_to_keep=1, **{kw: cache})
        n = len(context) - 1

        def hf_round() -> list[int]:
            crop(cache, n)
            tok, out = torch.tensor([[context[-1]]], device=dev), []
            for _ in range(k):
                tok = hf(input_ids=tok, use_cache=True, **{kw: cache}).logits[0, -1].argmax(-1).view(1, 1)
                out.append(tok)
            return torch.cat(out).flatten().tolist()

        hf_tokens = hf_round()
        t = wall(hf_round, args.rounds)
        ids = torch.tensor([context], device=dev)
        gen = wall(lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k,
                                       min_new_tokens=k, do_sample=False, pad_token_id=0), 5, warmup=1)
        res["transformers"] = {"how": f"manual greedy loop, {k} forwards with DynamicCache (sdpa), cache cropped per round",
                               "tokens_equal_ours": hf_tokens == ref.get("tokens"), "tokens": hf_tokens, **t,
                               "generate_incl_prefill": gen}
        log(f"  transformers: {t['median_ms']:.2f} ms; generate() incl. prefill {gen['median_ms']:.1f} ms")
        del hf, cache
        run.save()
    for name, opt in extra:
        one(name, opt)
        run.save()
    ratios(res)
    run.save()


def mismatch(stage: Stage, context: list[int], want: list[int], got: list[int]) -> dict:
    """Where graph drafts leave eager ones, and eager's logit gap there (a near tie flips under fp16)."""
    i = next(j for j, (a, b) in enumerate(zip(want, got)) if a != b)
    stage.rewind(len(context) - 1)
    logits = stage.step(torch.tensor([context[-1], *want[:i]], device=stage.device))[0, -1]
    return {"index": i, "eager": want[i], "graph": got[i],
            "eager_logit_gap": (logits[want[i]] - logits[got[i]]).item(), "logit_scale": logits.abs().max().item()}


def bench_verify(args, run: Run) -> None:
    dev = torch.device("cuda")
    cfg = ModelConfig.from_hf(QWEN25_7B)
    cut = cfg.n_layers // 2
    stages = [random_stage(cfg, 0, cut, device=dev, seed=2), random_stage(cfg, cut, cfg.n_layers, device=dev, seed=3)]
    for s in stages:
        s.setup_cache(args.max_len)
    T, start = args.k + 1, args.context
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (start,), generator=g).to(dev)
    tokens = torch.randint(0, cfg.vocab_size, (T,), generator=g).to(dev)
    with torch.no_grad():
        stages[1].step(stages[0].step(prompt))
    wbytes = weight_bytes(stages)
    bw = run.data["copy_bandwidth"]["gb_per_s"]
    res = run.data["verify"] = {
        "model": "Qwen2.5-7B shape, random fp16, two stages [0,14) [14,28) on one GPU", "tokens": T,
        "context": start, "max_len": args.max_len, "attention_span": span(start + T, args.max_len),
        "weight_bytes": wbytes,
        "kv_bytes": kv_bytes(cfg, cfg.n_layers, start + T), "floor_ms": wbytes / bw / 1e6,
        "target_ms": TARGETS_MS["verify"], "variants": {}}
    log(f"verify: {wbytes / 1e9:.2f} GB weights, floor {res['floor_ms']:.2f} ms")

    ref = {}

    def one(name: str, opt: dict) -> None:
        if run.left() < 60:
            res["variants"][name] = {"skipped": "time budget"}
            return
        if opt.pop("fuse", False):
            for s in stages:
                s.fuse()
        runners = [StageRunner(s, **opt) for s in stages]

        def verify() -> torch.Tensor:
            return runners[1](runners[0](tokens, start), start)

        t0 = time.perf_counter()
        try:
            out = verify().clone()
        except Exception as e:
            res["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            log(f"  {name}: FAILED {e}")
            return
        torch.cuda.synchronize()
        setup_s = time.perf_counter() - t0
        want = ref.setdefault("logits", out)
        t = wall(verify, args.rounds)
        v = {"setup_s": round(setup_s, 2), **t, "x_floor": t["median_ms"] / res["floor_ms"],
             "max_abs_diff_vs_eager": (out - want).abs().max().item(), "logit_scale": want.abs().max().item(),
             "argmax_equal_eager": int((out.argmax(-1) == want.argmax(-1)).sum()), "of": T}
        if runners[0].graphs:
            graphs = [r._captured[T, span(start + T, args.max_len)][0] for r in runners]

            def replay() -> None:
                for gr in graphs:
                    gr.replay()

            v["replay"] = device_time(replay, args.rounds)
            if args.profile and name != "graph_fused":
                v["profile"] = kernel_profile(replay)
            at = args.long_context

            def verify_long() -> torch.Tensor:
                return runners[1](runners[0](tokens, at), at)

            verify_long()
            v["long_context"] = {"context": at, "attention_span": span(at + T, args.max_len),
                                 **wall(verify_long, args.rounds)}
        res["variants"][name] = v
        log(f"  {name}: {t['median_ms']:.2f} ms (setup {setup_s:.1f} s) max|diff| vs eager {v['max_abs_diff_vs_eager']:.3g}"
            + (f"; {v['long_context']['median_ms']:.2f} ms at {at} tokens" if "long_context" in v else ""))

    standard, extra = variants(args)
    for name, opt in standard:
        one(name, opt)
        run.save()

    if args.transformers and run.left() > 60:
        hf = hf_twin(QWEN25_7B, stages)
        kw = hf_cache_kw(hf)
        from transformers import DynamicCache

        cache = DynamicCache()
        hf(input_ids=prompt[None], use_cache=True, logits_to_keep=1, **{kw: cache})

        def hf_verify() -> torch.Tensor:
            crop(cache, start)
            return hf(input_ids=tokens[None], use_cache=True, **{kw: cache}).logits

        logits = hf_verify().float()
        t = wall(hf_verify, args.rounds)
        res["transformers"] = {"how": f"one forward of {T} tokens after a {start}-token DynamicCache (sdpa), cropped per call",
                               "max_abs_diff_vs_our_eager": (logits - ref["logits"]).abs().max().item(),
                               "argmax_equal_our_eager": int((logits.argmax(-1) == ref["logits"].argmax(-1)).sum()), **t}
        log(f"  transformers: {t['median_ms']:.2f} ms, max|diff| vs ours {res['transformers']['max_abs_diff_vs_our_eager']:.3g}")
        del hf, cache
        run.save()
    for name, opt in extra:
        one(name, opt)
        run.save()
    ratios(res)
    run.save()


def ratios(res: dict) -> None:
    hf = res.get("transformers", {}).get("median_ms")
    for v in res["variants"].values():
        if "median_ms" in v and hf:
            v["speedup_vs_transformers"] = hf / v["median_ms"]
    done = {n: v["median_ms"] for n, v in res["variants"].items() if "median_ms" in v}
    if done:
        best = min(done, key=done.get)
        res["best"] = {"variant": best, "median_ms": done[best], "x_floor": done[best] / res["floor_ms"],
                       "meets_target": done[best] <= res["target_ms"]}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m kit bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["draft", "verify", "all"], help="which pass to time")
    p.add_argument("--k", type=int, default=8, help="draft tokens per round (verify passes k+1 tokens); default 8")
    p.add_argument("--context", type=int, default=500, help="committed tokens already in the KV cache; default 500")
    p.add_argument("--long-context", type=int, default=1800,
                   help="a second, longer context timed for graph variants (wider attention span); default 1800")
    p.add_argument("--max-len", type=int, default=4096, help="KV cache slots per stage (graphs attend over the power-of-two span that holds the context); default 4096")
    p.add_argument("--rounds", type=int, default=50, help="timed calls per variant (median reported); default 50")
    p.add_argument("--compile", nargs="*", default=["default"], metavar="MODE",
                   help="torch.compile modes to time as graph variants, e.g. default max-autotune-no-cudagraphs "
                        "(default: default; the flag alone: none)")
    p.add_argument("--compiled-only", action="store_true",
                   help="time eager (the reference output) and the compiled variants only, for quick A/B runs")
    p.add_argument("--no-transformers", dest="transformers", action="store_false",
                   help="skip the transformers eager baseline")
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="skip the per-kernel profile of graph replays")
    p.add_argument("--budget-s", type=float, default=480, help="skip remaining variants past this many seconds; default 480")
    p.add_argument("--out", type=Path, default=RESULT, help=f"JSON result path; default {RESULT.relative_to(ROOT)}")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.k < 1 or not 1 <= args.context <= args.long_context or args.long_context + 2 * args.k + 2 > args.max_len:
        print("error: need k >= 1, 1 <= context <= long-context and long-context + 2k + 2 <= max-len", file=sys.stderr)
        return 2
    torch.set_grad_enabled(False)
    run = Run(args.out, "python bench/draft_verify.py " + " ".join(argv), args.budget_s)
    run.data["copy_bandwidth"] = copy_bandwidth()
    log(f"{run.data['gpu']}: copy {run.data['copy_bandwidth']['gb_per_s']:.0f} GB/s")
    run.save()
    if args.what in ("draft", "all"):
        bench_draft(args, run)
        torch.cuda.empty_cache()
    if args.what in ("verify", "all"):
        bench_verify(args, run)
    for part in ("draft", "verify"):
        if part in run.data:
            r = run.data[part]
            log(f"\n{part}: floor {r['floor_ms']:.2f} ms, target {r['target_ms']} ms, "
                f"transformers {r.get('transformers', {}).get('median_ms', float('nan')):.2f} ms")
            for n, v in r["variants"].items():
                if "median_ms" in v:
                    log(f"  {n:28s} {v['median_ms']:7.2f} ms  x{v['x_floor']:.2f} floor  "
                        f"replay {v.get('replay', {}).get('median_ms', float('nan')):6.2f} ms")
                else:
                    log(f"  {n:28s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
