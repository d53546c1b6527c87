"""What the node notebooks run: the settings form, a quick relay check, and `python -m kit node` with its
output streamed live into the notebook and kept in the output folder."""
from __future__ import annotations

import codecs
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from kit.settings import BY_NAME, Settings

FORM_FIELDS = ["relay", "token", "fingerprint", "session", "target", "draft", "prompts"]


def interactive() -> bool:
    """A person is looking: an interactive Kaggle session or a Jupyter server's kernel (not papermill,
    nbclient, a committed run or `kaggle kernels push`). KIT_WIDGETS=0/1 overrides."""
    forced = os.environ.get("KIT_WIDGETS")
    if forced in ("0", "1"):
        return forced == "1"
    run_type = os.environ.get("KAGGLE_KERNEL_RUN_TYPE")
    if run_type is not None:
        return run_type == "Interactive"
    return "JPY_SESSION_NAME" in os.environ


def show_form(current: Settings, resolve: Callable[[dict], Settings]):
    """Text fields for what the form may set, a Connect button and a log. Never waits: Connect resolves
    again with the form's values, updates `current` in place and says to run the cells below. Fields that
    a stronger source already set (parameters, environment, Secrets) are shown disabled."""
    import ipywidgets as w
    from IPython.display import display

    boxes = {}
    for name in FORM_FIELDS:
        if name not in current.values:
            continue
        source, value = current.sources[name], current.values[name]
        fixed = source in ("parameters", "environment", "Kaggle Secrets", "relay card")
        shown = "" if value is None or BY_NAME[name].secret else value
        if name == "prompts":
            box = w.Textarea(value="\n".join(value or []), rows=4)
        elif BY_NAME[name].secret:
            box = w.Password(value="")
        else:
            box = w.Text(value=str(shown))
        box.description, box.disabled = name, fixed
        box.placeholder = f"set by {source}" if fixed else BY_NAME[name].help
        box.layout.width = "90%"
        boxes[name] = box
    button = w.Button(description="Connect", button_style="primary")
    log = w.Output(layout={"border": "1px solid #ccc"})

    def connect(_):
        log.clear_output()
        with log:
            try:
                new = resolve({n: b.value for n, b in boxes.items() if not b.disabled})
            except ValueError as e:
                print(f"error: {e}")
                return
            if new.missing:
                print("still missing: " + ", ".join(new.missing))
                return
            current.values.update(new.values)
            current.sources.update(new.sources)
            current.missing.clear()
            print(new.table())
            try:
                check_relay(new.relay)
                print(f"relay {new.relay} answers. Now run the cells below (Run > Run after selected cell).")
            except RuntimeError as e:
                print(f"error: {e}")

    button.on_click(connect)
    form = w.VBox([*boxes.values(), button, log])
    display(form)
    return form


def check_relay(address: str, timeout: float = 10.0) -> None:
    """Fail in seconds, not after loading the model, when the relay cannot be reached."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise RuntimeError(f"relay must be HOST:PORT, got {address!r}")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise RuntimeError(f"cannot reach the relay at {address}: {e}. Is it running, and is the port open "
                           f"in its firewall (EC2 security group)?") from None


def node_command(s: Settings, token_file: str) -> list[str]:
    """The `python -m kit node` call these settings mean."""
    cmd = [sys.executable, "-m", "kit", "node", "--stage", str(s.stage), "--stages", str(s.stages),
           "--relay", s.relay, "--session", s.session, "--token-file", token_file, "--target", s.target,
           "--device", "cpu" if s.cpu_test else "cuda"]
    if s.fingerprint:
        cmd += ["--fingerprint", s.fingerprint]
    if s.load_in_4bit:
        cmd.append("--load-in-4bit")
    if s.stage == 0:
        cmd += ["--draft", s.draft, "--k", str(s.k), "--max-new-tokens", str(s.max_new_tokens),
                "--metrics-dir", str(Path(s.out).resolve()), "--json"]
        for p in s.prompts:
            cmd += ["--prompt", p]
    return cmd + shlex.split(s.extra_args or "")


def stream(cmd: list[str], log_path: Path, on_line: Callable[[str], bool], timeout_s: float) -> int:
    """Run `cmd`, echo its output (stdout and stderr, progress bars included) as it comes, keep it in
    `log_path`; lines that `on_line` takes are not echoed. Killed after `timeout_s`."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending, shown = "", ""  # shown: the part of the current line already written (a progress bar)
    try:
        with open(log_path, "wb") as log:
            while chunk := os.read(proc.stdout.fileno(), 65536):
                log.write(chunk)
                log.flush()
                *lines, pending = (pending + decoder.decode(chunk)).split("\n")
                for line in lines:
                    if shown or not on_line(line):
                        sys.stdout.write(line + "\n")
                    shown = ""
                if pending and not pending.startswith("{"):  # a progress bar redrawn with \r: show it now
                    sys.stdout.write(pending)
                    shown, pending = shown + pending, ""
                sys.stdout.flush()
        if pending or shown:
            sys.stdout.write(pending + "\n")
        return proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run_node(s: Settings) -> dict:
    """Load this node's stage, join the relay, run (node 0: the prompts; others: serve until node 0 ends
    the session). Writes node<i>.log and run.json (node 0 also results.jsonl and the kit's metrics:
    rounds.jsonl, summary.json) into the output folder; raises when the node fails."""
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("rounds.jsonl", "summary.json", "results.jsonl"):
        (out / name).unlink(missing_ok=True)  # a rerun must not mix with the previous run's rounds
    check_relay(s.relay)
    fd, token_file = tempfile.mkstemp(prefix="kit-token-")  # never inside the output folder
    os.write(fd, s.token.encode())
    os.close(fd)
    results: list[dict] = []

    def on_line(line: str) -> bool:
        if not (line.startswith("{") and '"token_ids"' in line):
            return False
        r = json.loads(line)
        results.append(r)
        with open(out / "results.jsonl", "a") as f:
            f.write(line + "\n")
        print(f"\n--- prompt {len(results)}: {s.prompts[len(results) - 1]}\n{r['text']}\n"
              f"[{r['generated_tokens']} tokens, {r['tps']:.1f} tok/s, {r['tokens_per_round']:.2f} tokens/round, "
              f"TTFT {r['ttft_ms']:.0f} ms, {r['finish_reason']}]\n")
        return True

    cmd = node_command(s, token_file)
    print("$ " + shlex.join(cmd), flush=True)
    t0 = time.time()
    try:
        code = stream(cmd, out / f"node{s.stage}.log", on_line, s.max_minutes * 60)
    finally:
        os.unlink(token_file)
    run = {"stage": s.stage, "exit_code": code, "seconds": round(time.time() - t0, 1), "prompts": len(results),
           "settings": {k: v for k, v in s.values.items() if not BY_NAME[k].secret}}
    (out / "run.json").write_text(json.dumps(run, indent=1))
    if code != 0:
        why = (f"was stopped after max_minutes={s.max_minutes:g}" if run["seconds"] >= s.max_minutes * 60
               else f"exited with {code} after {run['seconds']:.0f} s")
        raise RuntimeError(f"`kit node` {why} (output above, also in {out / f'node{s.stage}.log'})")
    return {**run, "results": results}
