"""Command line: `python -m kit node|run|demo|bench|push` (contracts in DESIGN.md and README.md)."""
from __future__ import annotations

import argparse
import sys


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--target", required=True, help="target model: checkpoint folder, hub id (org/name) or .gguf file")
    g.add_argument("--draft", default="none",
                   help="drafter: a checkpoint (folder, hub id, .gguf) of the same tokenizer, self:L (the target's "
                        "first L layers + its head), ngram (prompt lookup) or none (default: none)")
    g.add_argument("--device", default="cpu",
                   help="device(s) of this node, comma separated: cpu, cuda, cuda:0,cuda:1 (default: cpu)")
    g.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"],
                   help="weight and activation dtype (default: float32 on CPU, float16 on CUDA)")
    g.add_argument("--load-in-4bit", action="store_true",
                   help="NF4 linear layers through bitsandbytes (embeddings and head keep --dtype)")
    g.add_argument("--max-len", type=int, default=2048, help="KV cache length in tokens, prompt included (default: 2048)")
    g.add_argument("--graphs", choices=["auto", "on", "off"], default="auto",
                   help="CUDA graphs for the draft loop and the verify pass (auto: on CUDA)")
    g.add_argument("--spin-ms", type=float, default=2.0,
                   help="wait for a frame awake (polling, for at most 10 ms) from this long before it is due, so it "
                        "is picked up at once; 0 = always sleep (default: 2)")


def add_generation_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation (stage 0)")
    g.add_argument("--prompt", action="append", help="prompt text, chat template applied unless --raw (repeatable)")
    g.add_argument("--prompts-file", help="a file with one prompt per line")
    g.add_argument("--prompt-ids", action="append",
                   help="prompt as comma-separated token ids, no template (repeatable)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--max-new-tokens", type=int, default=128, help="exact upper bound of generated tokens (default: 128)")
    g.add_argument("--k", type=int, default=4, help="draft tokens per round (default: 4)")
    g.add_argument("--adaptive-k", action="store_true", help="choose K each round (1..--k) from recent acceptance")
    g.add_argument("--depth", type=int, default=1,
                   help="rounds in flight: send round r+1 before round r's verdict (1 = off, default: 1)")
    g.add_argument("--no-overlap", action="store_true",
                   help="do not draft the next round while the current one is on the network")
    g.add_argument("--branches", type=int, default=8,
                   help="with overlap and a model drafter: also draft the next round after up to N likely "
                        "rejections (the drafter's runner-up tokens) while a round is out, as many as fit before "
                        "its verdict is due (0 = off, default: 8)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0 = off)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: 0 = off)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed; draws are keyed by (seed, position)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--metrics-dir", help="write rounds.jsonl and summary.json here")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of the text")
    g.add_argument("--quiet", action="store_true", help="no live progress line")
    g.add_argument("--stream", action="store_true", help="print the answer as it is generated (not with --json)")
    g.add_argument("--stage-timeout", type=float, default=60.0,
                   help="seconds a stage may stay away before the run ends with an error (default: 60)")
    g.add_argument("--ready-timeout", type=float, default=900.0,
                   help="seconds to wait for the other stages to load and join (default: 900)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kit", description="Run one LLM over GPU nodes joined by a relay, "
                                "with lossless speculative decoding.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{node,run,demo,bench,push}")

    node = sub.add_parser("node", help="run one stage of the ring (on each notebook)",
                          description="Load this stage's layers, join the ring through the relay, serve rounds. "
                                      "Stage 0 also owns the tokenizer and drafter and drives generation.")
    n = node.add_argument_group("ring")
    n.add_argument("--stage", type=int, required=True, help="this stage's index, 0..N-1")
    n.add_argument("--stages", type=int, required=True, help="number of stages N (>= 2)")
    n.add_argument("--relay", help="relay HOST:PORT (or from --relay-card)")
    n.add_argument("--relay-card", help="relay card JSON written by `python -m relay.provision`")
    n.add_argument("--session", default="kit", help="session name shared by the stages (default: kit)")
    n.add_argument("--token-file", help="file holding the session token (or from --relay-card)")
    n.add_argument("--fingerprint", help="relay TLS certificate SHA-256 fingerprint to pin (enables TLS)")
    n.add_argument("--layers", help="this stage's layer range START:END (default: an even split)")
    n.add_argument("--idle-timeout", type=float, default=None,
                   help="stages 1..N-1: leave after this many seconds without a frame from the ring (default: never)")
    add_model_args(node)
    add_generation_args(node)

    run = sub.add_parser("run", help="relay + one process per stage on this machine, optionally behind an emulated WAN",
                         description="Start a relay and one `kit node` process per stage on loopback, each behind a "
                                     "WAN emulator when --rtt-ms/--jitter-ms/--bandwidth-mbit are given, and print "
                                     "stage 0's result.")
    r = run.add_argument_group("local ring")
    r.add_argument("--stages", type=int, default=2, help="number of stage processes (default: 2)")
    r.add_argument("--rtt-ms", type=float, default=0.0,
                   help="emulated round trip node 0 -> relay -> node 1 -> relay -> node 0; each of the 4 links "
                        "gets a quarter one way (default: 0 = no emulator)")
    r.add_argument("--jitter-ms", type=float, default=0.0, help="extra random one-way delay per link, up to this")
    r.add_argument("--bandwidth-mbit", type=float, help="bandwidth cap per link and direction")
    r.add_argument("--relay", help="use this running relay HOST:PORT instead of starting one")
    r.add_argument("--relay-card", help="relay card JSON (relay, fingerprint, token) of a running relay")
    r.add_argument("--session", default=None, help="session name (default: random)")
    add_model_args(run)
    add_generation_args(run)

    demo = sub.add_parser("demo", help="the whole system on this machine: SmolLM2-135M, 2 stages, ~86 ms emulated RTT",
                          description="Run the embedded default twice on an emulated 86 ms round trip: speculative "
                                      "and plain decoding of the same prompt, and print both answers and speeds.")
    demo.add_argument("--prompt", default=None, help="prompt text (default: a built-in code-editing request)")
    demo.add_argument("--max-new-tokens", type=int, default=96, help="tokens to generate (default: 96)")
    demo.add_argument("--draft", default=None, help="drafter (default: ngram, prompt lookup)")
    demo.add_argument("--k", type=int, default=None, help="draft tokens per round (default: 4)")
    demo.add_argument("--rtt-ms", type=float, default=86.0, help="emulated round trip (default: 86)")
    demo.add_argument("--metrics-dir", default=None, help="keep both runs' metrics here")
    demo.add_argument("--json", action="store_true", help="print the comparison as JSON")

    bench = sub.add_parser("bench", help="benchmarks; JSON goes to bench/results/", add_help=False)
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    push = sub.add_parser("push", help="push both notebooks to Kaggle and fetch their output", add_help=False)
    push.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from kit.bench import main as bench_main
        return bench_main(argv[1:])
    if argv[:1] == ["push"]:
        from kit.push import main as push_main
        return push_main(argv[1:])
    args = parser().parse_args(argv)
    if getattr(args, "dtype", "x") is None:
        args.dtype = "float16" if args.device.startswith("cuda") else "float32"
    if args.command == "node":
        from kit.node import main as node_main
        return node_main(args)
    if args.command == "run":
        from kit.launch import main as run_main
        return run_main(args)
    from kit.launch import demo
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
