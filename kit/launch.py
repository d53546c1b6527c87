"""`kit run` and `kit demo`: a relay, WAN emulators and one `kit node` process per stage on this machine.

Every process is real (the same commands a user runs on a VM and on notebooks); only the internet is
emulated, by one `kit.wan` proxy between each stage and the relay.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kit.wan import per_link_delay_ms

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[2] if len(proc.args) > 2 else proc.args} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout:.0f} s")


class LocalCluster:
    """Relay, emulators and stage processes on loopback, with the handles that fault tests need:
    kill and restart a stage, restart the relay, cut every emulated link."""

    def __init__(self, stages: int, workdir: str | Path, *, rtt_ms: float = 0.0, jitter_ms: float = 0.0,
                 bandwidth_mbit: float | None = None, relay: str | None = None, token: str | None = None,
                 fingerprint: str | None = None, session: str | None = None, log_dir: str | Path | None = None,
                 wan_spin: bool = False):
        self.n = stages
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_dir = Path(log_dir) if log_dir else self.workdir
        self.rtt_ms, self.jitter_ms, self.bandwidth_mbit = rtt_ms, jitter_ms, bandwidth_mbit
        self.wan_spin = wan_spin  # emulators that never sleep (kit.wan --spin)
        self.external_relay = relay
        self.fingerprint = fingerprint
        self.session = session or f"run-{secrets.token_hex(4)}"
        self.token_file = self.workdir / "token"
        self.token_file.write_text(token or secrets.token_hex(32))
        os.chmod(self.token_file, 0o600)
        self.relay_port = int(relay.rpartition(":")[2]) if relay else free_port()
        self.relay_host = relay.rpartition(":")[0] if relay else "127.0.0.1"
        self.relay_proc: subprocess.Popen | None = None
        self.wans: list[subprocess.Popen] = []
        self.wan_ports: list[int] = []
        self.stages: dict[int, subprocess.Popen] = {}
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                    "PYTHONUNBUFFERED": "1"}
        # CPU stages share this machine's cores instead of each taking all of them
        self.env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // stages)))

    def _log(self, name: str):
        return open(self.log_dir / f"{name}.log", "ab")

    def start(self) -> None:
        if not self.external_relay:
            self.start_relay()
        if self.rtt_ms or self.jitter_ms or self.bandwidth_mbit:
            for i in range(self.n):
                self.start_wan(i)

    def start_relay(self) -> None:
        cmd = [sys.executable, "-m", "relay", "--host", "127.0.0.1", "--port", str(self.relay_port),
               "--token-file", str(self.token_file), "--auth-failures", "0"]
        self.relay_proc = subprocess.Popen(cmd, env=self.env, stdout=self._log("relay"), stderr=subprocess.STDOUT)
        wait_port(self.relay_port, proc=self.relay_proc)

    def restart_relay(self, down_s: float = 0.5) -> None:
        self.relay_proc.send_signal(signal.SIGTERM)
        self.relay_proc.wait(timeout=10)
        time.sleep(down_s)
        self.start_relay()

    def start_wan(self, i: int) -> None:
        ready = self.workdir / f"wan{i}.port"
        ready.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "kit.wan", "--listen", "127.0.0.1:0",
               "--upstream", f"{self.relay_host}:{self.relay_port}",
               "--delay-ms", str(per_link_delay_ms(self.rtt_ms)), "--jitter-ms", str(self.jitter_ms),
               "--seed", str(i), "--ready-file", str(ready)]
        if self.bandwidth_mbit:
            cmd += ["--bandwidth-mbit", str(self.bandwidth_mbit)]
        if self.wan_spin:
            cmd.append("--spin")
        proc = subprocess.Popen(cmd, env=self.env, stdout=self._log(f"wan{i}"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"WAN emulator {i} did not start (see {self.log_dir}/wan{i}.log)")
            time.sleep(0.05)
        self.wans.append(proc)
        self.wan_ports.append(int(ready.read_text()))

    def address(self, i: int) -> str:
        """Where stage i dials: its own emulated link, or the relay itself."""
        return f"127.0.0.1:{self.wan_ports[i]}" if self.wan_ports else f"{self.relay_host}:{self.relay_port}"

    def node_command(self, i: int, args: list[str]) -> list[str]:
        cmd = [sys.executable, "-m", "kit", "node", "--stage", str(i), "--stages", str(self.n),
               "--relay", self.address(i), "--session", self.session, "--token-file", str(self.token_file)]
        if self.fingerprint:
            cmd += ["--fingerprint", self.fingerprint]
        return cmd + args

    def start_stage(self, i: int, args: list[str], **popen) -> subprocess.Popen:
        if "stdout" not in popen:
            popen.update(stdout=self._log(f"stage{i}"), stderr=subprocess.STDOUT)
        proc = subprocess.Popen(self.node_command(i, args), env=self.env, **popen)
        self.stages[i] = proc
        return proc

    def kill_stage(self, i: int) -> None:
        self.stages[i].kill()
        self.stages[i].wait()

    def cut(self) -> None:
        """Cut every emulated link once (the emulators keep listening, so the stages redial)."""
        for w in self.wans:
            w.send_signal(signal.SIGUSR1)

    def close(self) -> None:
        procs = list(self.stages.values()) + self.wans + ([self.relay_proc] if self.relay_proc else [])
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def node_args(args) -> list[str]:
    """The `kit node` options that `kit run` passes through to every stage."""
    out = ["--target", args.target, "--draft", args.draft, "--device", args.device, "--dtype", args.dtype,
           "--max-len", str(args.max_len), "--graphs", args.graphs, "--stage-timeout", str(args.stage_timeout),
           "--spin-ms", str(args.spin_ms)]
    if args.load_in_4bit:
        out.append("--load-in-4bit")
    return out


def stage0_args(args) -> list[str]:
    out = ["--max-new-tokens", str(args.max_new_tokens), "--k", str(args.k), "--depth", str(args.depth),
           "--branches", str(args.branches),
           "--temperature", str(args.temperature), "--top-p", str(args.top_p), "--top-k", str(args.top_k),
           "--seed", str(args.seed), "--ready-timeout", str(args.ready_timeout)]
    for p in args.prompt or []:
        out += ["--prompt", p]
    for ids in args.prompt_ids or []:
        out += ["--prompt-ids", ids]
    for s in args.stop or []:
        out += ["--stop", s]
    for flag, on in (("--raw", args.raw), ("--adaptive-k", args.adaptive_k), ("--no-overlap", args.no_overlap),
                     ("--json", args.json), ("--quiet", args.quiet), ("--stream", args.stream)):
        if on:
            out.append(flag)
    for opt, val in (("--prompts-file", args.prompts_file),
                     ("--metrics-dir", args.metrics_dir)):
        if val:
            out += [opt, val]
    return out


def main(args) -> int:
    """`kit run`: start everything, let stage 0 drive, pass its output through, stop everything."""
    if args.stages < 2:
        raise SystemExit("error: --stages must be at least 2 (one process per stage)")
    if not (args.prompt or args.prompt_ids or args.prompts_file):
        raise SystemExit("error: give --prompt, --prompt-ids or --prompts-file")
    from kit.load import CheckpointError, ConfigError, load_config
    try:
        load_config(args.target)  # a bad target fails here, once, before any process starts
    except (CheckpointError, ConfigError) as e:
        raise SystemExit(f"error: {e}")
    card = {}
    if args.relay_card:
        from kit.node import read_card
        card = read_card(args.relay_card)
    relay = args.relay or card.get("relay")
    with tempfile.TemporaryDirectory(prefix="kit-run-") as tmp:
        cluster = LocalCluster(args.stages, tmp, rtt_ms=args.rtt_ms, jitter_ms=args.jitter_ms,
                               bandwidth_mbit=args.bandwidth_mbit, relay=relay, token=card.get("token"),
                               fingerprint=card.get("fingerprint"), session=args.session)
        try:
            cluster.start()
            for i in range(1, args.stages):
                cluster.start_stage(i, node_args(args))
            stage0 = cluster.start_stage(0, node_args(args) + stage0_args(args), stdout=None, stderr=None)
            code = stage0.wait()
        except KeyboardInterrupt:
            code = 130
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            code = 1
        finally:
            cluster.close()
        if code != 0:
            for i in range(1, args.stages):
                log = Path(tmp) / f"stage{i}.log"
                if log.exists():
                    tail = log.read_text(errors="replace").strip().splitlines()[-5:]
                    print(f"--- stage {i} (last lines) ---\n" + "\n".join(tail), file=sys.stderr)
        return code


# Prompt lookup pays where the answer repeats the prompt (editing, refactoring, summarising);
# SmolLM2-135M has no smaller sibling and its own first layers accept little
# (bench/results/acceptance_smollm2.json), so the demo edits code with the ngram drafter.
DEMO_PROMPT = ("Add type hints and a one-line docstring to this Python function, and return the whole function:\n\n"
               "def moving_average(values, window):\n"
               "    result = []\n"
               "    for i in range(len(values) - window + 1):\n"
               "        chunk = values[i:i + window]\n"
               "        result.append(sum(chunk) / window)\n"
               "    return result\n")


def demo(args) -> int:
    """`kit demo`: SmolLM2-135M-Instruct over 2 stages and an emulated 86 ms round trip, speculative and
    plain, same prompt; prints both answers and their speeds."""
    from kit.load import smollm2_gguf

    target = smollm2_gguf()
    prompt = args.prompt or DEMO_PROMPT
    draft = args.draft or DEMO_DRAFT
    k = args.k or DEMO_K
    results = {}
    with tempfile.TemporaryDirectory(prefix="kit-demo-") as tmp:
        for name, d, kk in (("speculative", draft, k), ("plain", "none", 1)):
            metrics = Path(args.metrics_dir or tmp) / name
            cmd = [sys.executable, "-m", "kit", "run", "--target", target, "--draft", d, "--k", str(kk),
                   "--stages", "2", "--rtt-ms", str(args.rtt_ms), "--max-new-tokens", str(args.max_new_tokens),
                   "--prompt", prompt, "--metrics-dir", str(metrics), "--json", "--quiet"]
            print(f"[demo] {name}: {d}, K={kk}, 2 stages, {args.rtt_ms:g} ms emulated round trip ...", file=sys.stderr)
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            if proc.returncode != 0:
                print(f"error: the {name} run failed (exit {proc.returncode})", file=sys.stderr)
                return proc.returncode
            results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
            results[name]["draft"], results[name]["k"] = d, kk
    spec, plain = results["speculative"], results["plain"]
    same = spec["token_ids"] == plain["token_ids"]
    if args.json:
        print(json.dumps({"prompt": prompt, "rtt_ms": args.rtt_ms, "identical": same, **results}))
        return 0
    print(f"\nPrompt: {prompt}\n\n{spec['text']}\n")
    for name, r in results.items():
        print(f"{name:>12}: {r['tps']:6.2f} tok/s  {r['tokens_per_round']:.2f} tokens/round  "
              f"TTFT {r['ttft_ms']:.0f} ms  ({r['generated_tokens']} tokens, drafter {r['draft']}, K={r['k']})")
    print(f"{'speed-up':>12}: {spec['tps'] / plain['tps']:.2f}x   identical output: {'yes' if same else 'NO'}")
    return 0 if same else 1


DEMO_DRAFT = "ngram"
DEMO_K = 4
