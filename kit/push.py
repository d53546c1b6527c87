"""`python -m kit push`: run both node notebooks on Kaggle, each under its own account, and fetch their output.

For each notebook it writes a folder with a copy whose parameters cell is followed by the values given here
(never the token: that stays a Kaggle Secret) and its kernel-metadata.json, then pushes it, polls the run's
status and downloads its output. Every Kaggle call goes through the `kaggle` package's KaggleApi in a child
process that sees only one account's kaggle.json: the package reads credentials from the environment and
the home folder, so two accounts cannot share one process safely (and importing `kaggle` without
credentials ends the process).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NODES = [("node0_iowa", "kit-node0-iowa", "kit node0 iowa"), ("node1_oregon", "kit-node1-oregon", "kit node1 oregon")]
MACHINE_SHAPE = "NvidiaTeslaT4"  # Kaggle's "GPU T4 x2"
DONE = {"COMPLETE", "ERROR", "CANCEL_REQUESTED", "CANCEL_ACKNOWLEDGED"}
NODE0_ONLY = {"draft", "k", "max_new_tokens", "prompts"}

HINTS = {
    "quota": "GPU quota: the account has used its weekly GPU hours (the editor shows what is left under "
             "Settings > Accelerator; the quota resets weekly). Wait for the reset or use other accounts.",
    "phone": "Phone verification: GPUs and internet in notebooks need a phone-verified account: "
             "kaggle.com > Settings > Phone Verification, then push again.",
    "secrets": "Secrets not attached: open the notebook on kaggle.com (Edit), Add-ons > Secrets, add KIT_TOKEN "
               "(and KIT_RELAY, KIT_FINGERPRINT, or the whole card as KIT_RELAY_CARD), tick it for this notebook, "
               "then push again. Secrets are attached once per notebook.",
    "credentials": "Credentials refused: make a new token at kaggle.com > Settings > API > Create New Token and "
                   "give its kaggle.json.",
}


def hints(text: str) -> list[str]:
    """What to do about a failed push or run, from its message (all hints when nothing matches)."""
    t = text.lower()
    keys = [k for k, words in (("quota", ("quota",)), ("phone", ("phone", "verif")),
                               ("secrets", ("missingsettings", "missing settings", "kit_token", "secret")),
                               ("credentials", ("401", "unauthorized", "invalid credentials")))
            if any(w in t for w in words)]
    if "403" in t and not keys:
        keys = ["phone", "credentials"]
    return [HINTS[k] for k in (keys or HINTS)]


@dataclass
class Account:
    user: str
    credentials: Path | None  # kaggle.json or an API token file; None: a name only (enough for --dry-run)
    token: bool = False  # credentials hold an API token (kaggle.com > Settings > API > Generate New Token)


def account(path: str | None, user: str | None, which: str) -> Account:
    """An account from a kaggle.json (username, key) or a file holding an API token (then --userN names it)."""
    if not path:
        if not user:
            raise SystemExit(f"error: give --account{which} (kaggle.json or API token file), or --user{which} NAME "
                             f"with --dry-run")
        return Account(user, None)
    try:
        text = Path(path).read_text().strip()
    except OSError as e:
        raise SystemExit(f"error: cannot read --account{which} {path}: {e.strerror}")
    if not text.startswith("{"):
        if not text or len(text.split()) != 1:
            raise SystemExit(f"error: {path} is neither a kaggle.json nor a file holding one API token")
        if not user:
            raise SystemExit(f"error: --account{which} {path} holds an API token: name its account with --user{which}")
        return Account(user, Path(path), token=True)
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise SystemExit(f"error: {path} is not valid JSON: {e}")
    if not isinstance(doc, dict) or not doc.get("username") or not doc.get("key"):
        raise SystemExit(f"error: {path} is not a kaggle.json with username and key")
    if user and user != doc["username"]:
        raise SystemExit(f"error: --user{which} {user} differs from the username in {path}")
    return Account(doc["username"], Path(path))


def parameters(args, node: int) -> dict:
    """The values written into a notebook's parameters (only those given; never the token)."""
    card = {}
    if args.relay_card:
        try:
            card = json.loads(Path(args.relay_card).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: cannot read --relay-card {args.relay_card}: {e}")
    values = {"relay": args.relay or card.get("relay"), "fingerprint": args.fingerprint or card.get("fingerprint"),
              "session": args.session, "target": args.target, "draft": args.draft, "k": args.k,
              "max_new_tokens": args.max_new_tokens, "prompts": args.prompt, "kit_source": args.kit_source,
              "load_in_4bit": True if args.load_in_4bit else None}
    for item in args.param or []:
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            raise SystemExit(f"error: --param needs NAME=VALUE, got {item!r}")
        if name in ("token", "relay_card"):
            raise SystemExit("error: the token must not be written into a notebook: attach it as the Kaggle Secret "
                             "KIT_TOKEN")
        values[name] = value
    return {k: v for k, v in values.items() if v is not None and (node == 0 or k not in NODE0_ONLY)}


def inject(notebook: dict, values: dict) -> dict:
    """The notebook with a cell setting `values` right after its `parameters` cell (what papermill does)."""
    cells = [c for c in notebook["cells"] if "injected-parameters" not in c.get("metadata", {}).get("tags", [])]
    at = next((i for i, c in enumerate(cells) if "parameters" in c.get("metadata", {}).get("tags", [])), None)
    if at is None:
        raise SystemExit("error: the notebook has no cell tagged `parameters`")
    source = "# Parameters written by `python -m kit push`\n" + "".join(f"{k} = {v!r}\n" for k, v in values.items())
    cell = {"cell_type": "code", "execution_count": None, "id": "injected-parameters",
            "metadata": {"tags": ["injected-parameters"]}, "outputs": [], "source": source}
    return {**notebook, "cells": cells[: at + 1] + [cell] + cells[at + 1:]}


def metadata(user: str, slug: str, title: str, code_file: str, datasets: list[str], competitions: list[str]) -> dict:
    """kernel-metadata.json: a private GPU T4 x2 notebook with internet, on Kaggle's current image."""
    return {"id": f"{user}/{slug}", "title": title, "code_file": code_file, "language": "python",
            "kernel_type": "notebook", "is_private": True, "enable_gpu": True, "enable_tpu": False,
            "enable_internet": True, "machine_shape": MACHINE_SHAPE, "dataset_sources": datasets,
            "competition_sources": competitions, "kernel_sources": [], "model_sources": []}


def build(args, accounts: list[Account]) -> list[Path]:
    folders = []
    for node, ((name, slug, title), acc) in enumerate(zip(NODES, accounts)):
        folder = Path(args.build) / f"node{node}"
        folder.mkdir(parents=True, exist_ok=True)
        nb = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
        (folder / f"{name}.ipynb").write_text(json.dumps(inject(nb, parameters(args, node)), indent=1))
        meta = metadata(acc.user, slug, title, f"{name}.ipynb", args.dataset or [], args.competition or [])
        (folder / "kernel-metadata.json").write_text(json.dumps(meta, indent=1) + "\n")
        folders.append(folder)
    return folders


def call(acc: Account, op: str, **kw) -> dict:
    """One KaggleApi call (push, status, output) in a child process that sees only `acc`'s credentials."""
    with tempfile.TemporaryDirectory(prefix="kit-kaggle-") as home:
        conf = Path(home) / ".kaggle"
        conf.mkdir()
        name = "access_token" if acc.token else "kaggle.json"
        shutil.copyfile(acc.credentials, conf / name)
        os.chmod(conf / name, 0o600)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KAGGLE_")}
        env.update(HOME=home, KAGGLE_CONFIG_DIR=str(conf), XDG_CONFIG_HOME=str(Path(home) / ".config"),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        proc = subprocess.run([sys.executable, "-c", "from kit.push import worker; worker()"], env=env,
                              input=json.dumps({"op": op, **kw}), capture_output=True, text=True, timeout=600)
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        return {"error": (proc.stdout + proc.stderr).strip()[-2000:] or f"the kaggle call exited with {proc.returncode}"}


def worker() -> None:
    """Child side of `call`: one request on stdin, its result as the last line of stdout."""
    req = json.loads(sys.stdin.read())
    from kaggle.api.kaggle_api_extended import KaggleApi

    api = KaggleApi()
    api.authenticate()
    try:
        if req["op"] == "push":
            r = api.kernels_push(req["folder"], no_run=req.get("no_run", False))
            out = {"ref": r.ref, "url": r.url, "version": r.version_number, "error": r.error or ""}
        elif req["op"] == "status":
            r = api.kernels_status(req["kernel"])
            out = {"status": r.status.name, "message": r.failure_message or ""}
        else:
            files, _ = api.kernels_output(req["kernel"], req["path"], force=True, quiet=True)
            out = {"files": files}
    except Exception as e:  # HTTP errors carry Kaggle's message: show it, with what to do
        status = getattr(getattr(e, "response", None), "status_code", None)
        out = {"error": f"{type(e).__name__}: {e}" + (f" (HTTP {status})" if status else "")}
    print(json.dumps(out), flush=True)


def plan(accounts: list[Account], folders: list[Path], args) -> list[str]:
    """The calls, as the equivalent `kaggle` commands (run as which account)."""
    refs = [f"{a.user}/{slug}" for a, (_, slug, _) in zip(accounts, NODES)]
    run = " --no-run" if args.no_run else ""  # kaggle 2.x: save a version without running it
    lines = [f"[as {a.user}] kaggle kernels push -p {shlex.quote(str(f))}{run}"
             for a, f in reversed(list(zip(accounts, folders)))]
    if not (args.no_run or args.no_wait):
        lines += [f"[as {a.user}] kaggle kernels status {r}    (every {args.poll:g} s until it ends, at most "
                  f"{args.timeout:g} s)" for a, r in zip(accounts, refs)]
        lines += [f"[as {a.user}] kaggle kernels output {r} -p {shlex.quote(str(Path(args.results) / f'node{i}'))}"
                  for i, (a, r) in enumerate(zip(accounts, refs))]
    return lines


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kit push", description=(
        "Push notebooks/node0_iowa.ipynb and node1_oregon.ipynb to Kaggle as private GPU T4 x2 notebooks with "
        "internet, each under its own account (one person per account), wait for both runs, and download "
        "their output. Values given here are written into each notebook after its parameters cell; the "
        "session token never is: attach it once to each notebook as the Kaggle Secret KIT_TOKEN."))
    a = p.add_argument_group("accounts")
    a.add_argument("--account0", metavar="FILE",
                   help="credentials of the account that runs node 0: its kaggle.json (username, key), or a file "
                        "holding one API token (kaggle.com > Settings > API), then with --user0")
    a.add_argument("--account1", metavar="FILE", help="credentials of the account that runs node 1 (as --account0)")
    a.add_argument("--user0", help="node 0's account name: needed with an API token file, or alone for --dry-run")
    a.add_argument("--user1", help="node 1's account name: needed with an API token file, or alone for --dry-run")
    s = p.add_argument_group("notebook settings (written into both notebooks; node 0 only: draft, k, "
                             "max-new-tokens, prompt)")
    s.add_argument("--relay-card", help="relay card JSON from `python -m relay.provision`: its relay and "
                                        "fingerprint are written (its token is not)")
    s.add_argument("--relay", help="relay HOST:PORT (overrides the card's)")
    s.add_argument("--fingerprint", help="relay TLS certificate SHA-256 fingerprint (overrides the card's)")
    s.add_argument("--session", default=None, help="session name shared by both notebooks (default: a fresh random one)")
    s.add_argument("--target", help="target model (default: the notebooks' default, Qwen/Qwen2.5-7B-Instruct)")
    s.add_argument("--draft", help="drafter of node 0 (default: the notebook's default)")
    s.add_argument("--k", type=int, help="draft tokens per round")
    s.add_argument("--max-new-tokens", type=int, help="tokens per prompt")
    s.add_argument("--prompt", action="append", help="a prompt for node 0 (repeatable; default: the notebook's list)")
    s.add_argument("--load-in-4bit", action="store_true", help="NF4 weights through bitsandbytes on both nodes")
    s.add_argument("--kit-source", help="git URL (or folder) the notebooks fetch the kit from, when no Kaggle Dataset "
                                        "holding it is attached")
    s.add_argument("--param", action="append", metavar="NAME=VALUE",
                   help="any other notebook parameter, as a string (repeatable), e.g. extra_args=--depth 2")
    k = p.add_argument_group("kaggle")
    k.add_argument("--dataset", action="append", metavar="OWNER/SLUG",
                   help="a Kaggle Dataset to attach to both notebooks (repeatable), e.g. the kit itself")
    k.add_argument("--competition", action="append", metavar="SLUG",
                   help="a competition's data to attach to both notebooks (repeatable)")
    k.add_argument("--build", default="runs/kaggle/push",
                   help="folder for the notebook copies and their kernel-metadata.json (default: runs/kaggle/push)")
    k.add_argument("--results", default="runs/kaggle/results",
                   help="folder the outputs are downloaded to, one subfolder per node (default: runs/kaggle/results)")
    k.add_argument("--poll", type=float, default=30.0, help="seconds between status checks (default: 30)")
    k.add_argument("--timeout", type=float, default=7200.0,
                   help="seconds to wait for both runs to end before giving up (default: 7200)")
    k.add_argument("--no-run", action="store_true",
                   help="save both notebooks without running them (first time: then attach the secrets)")
    k.add_argument("--no-wait", action="store_true", help="push and return; do not poll or download")
    k.add_argument("--dry-run", action="store_true",
                   help="write both folders and print the calls it would make; contact nobody")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.session = args.session or f"kit-{secrets.token_hex(4)}"
    accounts = [account(args.account0, args.user0, "0"), account(args.account1, args.user1, "1")]
    if accounts[0].user == accounts[1].user:
        raise SystemExit("error: node 0 and node 1 need two different Kaggle accounts (one person each)")
    folders = build(args, accounts)
    for f in folders:
        print(f"wrote {f / 'kernel-metadata.json'} and {next(f.glob('*.ipynb')).name}")
    print(f"session: {args.session}")
    print("calls (each through the kaggle package's KaggleApi, in a process that sees only that account's "
          "credentials):\n" + "\n".join("  " + line for line in plan(accounts, folders, args)))
    if args.dry_run:
        return 0
    if any(a.credentials is None for a in accounts):
        raise SystemExit("error: pushing needs --account0 and --account1 (credential files); --user0/--user1 alone "
                         "are enough only for --dry-run")

    refs = [f"{a.user}/{slug}" for a, (_, slug, _) in zip(accounts, NODES)]
    failed = []
    for i in (1, 0):  # node 1 first: node 0 waits for it
        r = call(accounts[i], "push", folder=str(folders[i]), no_run=args.no_run)
        if r.get("error"):
            print(f"error: pushing node {i} as {accounts[i].user} failed: {r['error']}", file=sys.stderr)
            for h in hints(r["error"]):
                print(f"  - {h}", file=sys.stderr)
            failed.append(i)
        else:
            print(f"pushed node {i}: {r.get('url') or refs[i]} (version {r.get('version')})")
    if failed:
        if not args.no_run and len(failed) == 1:
            print("note: the notebook that was pushed is running; without its partner it stops after max_minutes "
                  "(60 by default), or stop it now in its editor on kaggle.com", file=sys.stderr)
        return 1
    if args.no_run:
        print("saved without running. Attach the Kaggle Secret KIT_TOKEN to each notebook (Edit > Add-ons > "
              "Secrets), then push again without --no-run.")
        return 0
    if args.no_wait:
        return 0
    return wait_and_fetch(args, accounts, refs)


def wait_and_fetch(args, accounts: list[Account], refs: list[str]) -> int:
    status = [{"status": "?"} for _ in refs]
    deadline = time.monotonic() + args.timeout
    while True:
        for i, acc in enumerate(accounts):
            if status[i]["status"] in DONE:
                continue
            new = call(acc, "status", kernel=refs[i])
            if new.get("error"):
                print(f"node {i}: cannot read the status: {new['error']}", file=sys.stderr)
                continue
            if new["status"] != status[i]["status"]:
                print(f"node {i} ({refs[i]}): {new['status']}" + (f": {new['message']}" if new["message"] else ""))
            status[i] = new
        if all(s["status"] in DONE for s in status) or time.monotonic() > deadline:
            break
        time.sleep(args.poll)
    code = 0
    for i, acc in enumerate(accounts):
        folder = Path(args.results) / f"node{i}"
        got = call(acc, "output", kernel=refs[i], path=str(folder))
        if got.get("error"):
            print(f"node {i}: cannot download the output: {got['error']}", file=sys.stderr)
        else:
            print(f"node {i}: {len(got['files'])} files in {folder}")
        if status[i]["status"] not in DONE:
            code = 1
            print(f"error: node {i} is still {status[i]['status']} after {args.timeout:g} s; it goes on running on "
                  f"Kaggle (kaggle kernels status {refs[i]})", file=sys.stderr)
        elif status[i]["status"] != "COMPLETE":
            code = 1
            logs = " ".join(p.read_text(errors="replace")[-20000:] for p in folder.glob("*.log")) if folder.is_dir() else ""
            print(f"error: node {i} ended as {status[i]['status']} {status[i].get('message', '')}", file=sys.stderr)
            for h in hints(f"{status[i].get('message', '')} {logs}"):
                print(f"  - {h}", file=sys.stderr)
    if code == 0:
        print(f"done. Plot: papermill notebooks/results.ipynb out.ipynb -y '{{\"runs\": [\"{Path(args.results) / 'node0'}\"]}}'"
              f" (or open notebooks/results.ipynb and set runs)")
    return code
