"""The Kaggle notebooks, executed headless by papermill exactly as `kit push`/CI would, on this machine.

Both node notebooks run at once, as two kernels, in CPU test mode with SmolLM2-135M against a local relay;
node 0 must produce the target-only greedy tokens. results.ipynb then plots what node 0 wrote next to a
non-speculative run. "Run All" without settings must stop in the settings cell, at once, naming them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kit.launch import LocalCluster
from kit.settings import SPECS

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
PROMPT = "Repeat this line twice: the quick brown fox jumps over the lazy dog."
MAX_NEW = 24
SETTING_ENV = {s.env for s in SPECS} | {"KIT_SOURCE", "KIT_WIDGETS", "JPY_SESSION_NAME", "KAGGLE_KERNEL_RUN_TYPE"}


def clean_env(**extra: str) -> dict:
    """This environment without any notebook setting, the kit importable, one thread per process."""
    env = {k: v for k, v in os.environ.items() if k not in SETTING_ENV}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def papermill(name: str, out: Path, params: dict, env: dict) -> subprocess.Popen:
    (out.parent / f"{out.stem}.params.json").write_text(json.dumps(params))
    cmd = [sys.executable, "-m", "papermill", str(NOTEBOOKS / name), str(out), "-f",
           str(out.parent / f"{out.stem}.params.json"), "-k", "python3", "--log-output", "--execution-timeout", "240"]
    return subprocess.Popen(cmd, env=env, stdout=open(out.with_suffix(".log"), "w"), stderr=subprocess.STDOUT)


def wait(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def cell_text(cell: dict) -> str:
    text = []
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream":
            text.append("".join(o["text"]))
        elif o["output_type"] == "error":
            text.append(f"{o['ename']}: {o['evalue']}")
    return "".join(text)


def tagged(nb_path: Path, tag: str) -> dict:
    nb = json.loads(nb_path.read_text())
    return next(c for c in nb["cells"] if tag in c["metadata"].get("tags", []))


@pytest.fixture(scope="module")
def runs(smol_dir, tmp_path_factory):
    """Both node notebooks against one relay, and a plain `kit run --draft none` baseline, all at once."""
    tmp = tmp_path_factory.mktemp("kaggle")
    with LocalCluster(2, tmp / "relay") as relay:
        address, token = f"127.0.0.1:{relay.relay_port}", relay.token_file.read_text()
        common = {"session": relay.session, "target": str(smol_dir), "cpu_test": True, "max_minutes": 4}
        node0 = {**common, "relay": address, "draft": "ngram", "k": 4, "max_new_tokens": MAX_NEW,
                 "prompts": [PROMPT], "out": str(tmp / "node0"),
                 "extra_args": "--max-len 256 --ready-timeout 150 --stage-timeout 60"}
        node1 = {**common, "out": str(tmp / "node1"), "extra_args": "--max-len 256"}
        t0 = time.monotonic()
        procs = [
            # node 0's token comes from the environment, node 1's relay and token from a relay card
            papermill("node0_iowa.ipynb", tmp / "node0.ipynb", node0, clean_env(KIT_TOKEN=token)),
            papermill("node1_oregon.ipynb", tmp / "node1.ipynb", node1,
                      clean_env(KIT_RELAY_CARD=json.dumps({"relay": address, "token": token}))),
            subprocess.Popen([sys.executable, "-m", "kit", "run", "--target", str(smol_dir), "--draft", "none",
                              "--max-new-tokens", str(MAX_NEW), "--prompt", PROMPT, "--max-len", "256",
                              "--metrics-dir", str(tmp / "baseline"), "--json", "--quiet"],
                             env=clean_env(), stdout=subprocess.DEVNULL, stderr=open(tmp / "baseline.log", "w")),
        ]
        codes = wait(procs, 300)
        seconds = time.monotonic() - t0
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp.glob("*.log")))
    assert codes == [0, 0, 0], logs
    print(f"\nboth node notebooks and the baseline ran in {seconds:.1f} s")
    return tmp


@pytest.mark.timeout(420)
def test_node_notebooks_generate_target_only_greedy(runs, smol_dir):
    from transformers import AutoTokenizer

    from kit.draft import NoDrafter
    from kit.generate import generate
    from kit.graphs import StageRunner
    from kit.load import load_config, load_stage
    from kit.node import chat_ids, eos_ids

    tok = AutoTokenizer.from_pretrained(str(smol_dir))
    cfg = load_config(str(smol_dir))
    stage = load_stage(str(smol_dir), 0, cfg.n_layers, max_len=256, progress=False)
    ref = generate([StageRunner(stage, graphs=False)], NoDrafter(), chat_ids(tok, PROMPT, raw=False),
                   max_new_tokens=MAX_NEW, eos_ids=eos_ids(smol_dir, cfg, tok)).token_ids

    summary = json.loads((runs / "node0" / "summary.json").read_text())
    results = [json.loads(line) for line in (runs / "node0" / "results.jsonl").read_text().splitlines()]
    assert summary["token_ids"] == ref and [r["token_ids"] for r in results] == [ref]
    assert json.loads((runs / "baseline" / "summary.json").read_text())["token_ids"] == ref
    assert sum(r["accepted"] for r in map(json.loads, (runs / "node0" / "rounds.jsonl").read_text().splitlines())) > 0

    run_cell = cell_text(tagged(runs / "node0.ipynb", "run"))
    assert "layers 0-" in run_cell and "tensor/s" in run_cell  # the loading progress bar, streamed live
    assert tok.decode(ref, skip_special_tokens=True) in run_cell  # the answer
    assert "tok/s" in cell_text(tagged(runs / "node0.ipynb", "metrics"))
    assert "serving" in cell_text(tagged(runs / "node1.ipynb", "run"))
    for node in (0, 1):
        run = json.loads((runs / f"node{node}" / "run.json").read_text())
        assert run["exit_code"] == 0 and run["stage"] == node
        assert "token" not in run["settings"] and "relay_card" not in run["settings"]
        assert (runs / f"node{node}" / f"node{node}.log").stat().st_size > 0
    settings1 = cell_text(tagged(runs / "node1.ipynb", "settings"))
    assert "(relay card)" in settings1 and "(environment)" in settings1  # where each setting came from


@pytest.mark.timeout(300)
def test_results_notebook_draws_every_figure_from_the_metrics(runs):
    import matplotlib.image

    figures = runs / "figures"
    p = papermill("results.ipynb", runs / "results.ipynb",
                  {"runs": [str(runs / "node0")], "baseline": str(runs / "baseline"), "figures": str(figures)},
                  clean_env())
    assert wait([p], 180) == [0], (runs / "results.log").read_text()[-3000:]
    for name in ("tps_over_time.png", "round_latency.png", "acceptance.png", "rtt_ecdf.png"):
        pixels = matplotlib.image.imread(figures / name)[..., :3]
        assert pixels.shape[0] > 200 and pixels.shape[1] > 300 and pixels.var() > 1e-3, name  # not blank

    numbers = json.loads((figures / "numbers.json").read_text())
    assert sorted(numbers["figures"]) == ["acceptance.png", "round_latency.png", "rtt_ecdf.png", "tps_over_time.png"]
    printed = cell_text(tagged(runs / "results.ipynb", "numbers"))
    for row, folder in ((numbers["runs"][0], runs / "node0"), (numbers["baseline"], runs / "baseline")):
        rounds = [json.loads(line) for line in (folder / "rounds.jsonl").read_text().splitlines()]
        summary = json.loads((folder / "summary.json").read_text())
        assert row["rounds"] == len(rounds) == summary["rounds"]
        assert row["tokens"] == sum(r["committed"] for r in rounds) == summary["generated_tokens"]
        assert row["tokens_per_round"] == pytest.approx(summary["tokens_per_round"])
        assert row["mean_accepted"] == pytest.approx(np.mean([r["accepted"] for r in rounds]))
        assert row["tps"] == summary["tps"] and row["ttft_ms"] == summary["ttft_ms"]
        for key in ("round_ms", "round_ms_p50", "round_ms_p90", "round_ms_p99", "draft_ms", "network_ms"):
            assert row[key] == pytest.approx(summary[key]), key
        assert row["acceptance_by_position"] == pytest.approx(summary["acceptance_by_position"])
        assert f"{summary['tps']:.2f}" in printed and f"{summary['round_ms_p90']:.1f}" in printed
    speedup = numbers["runs"][0]["speedup"]
    assert speedup == pytest.approx(numbers["runs"][0]["tps"] / numbers["baseline"]["tps"])
    assert f"{speedup:.2f}x" in printed


@pytest.mark.timeout(180)
def test_run_all_without_settings_fails_fast_in_the_settings_cell(tmp_path):
    t0 = time.monotonic()
    # a CPU machine, nothing else; node 1 as if a person were looking: the form shows and blocks nothing
    procs = [papermill("node0_iowa.ipynb", tmp_path / "node0_iowa.ipynb", {}, clean_env(KIT_CPU_TEST="1")),
             papermill("node1_oregon.ipynb", tmp_path / "node1_oregon.ipynb", {},
                       clean_env(KIT_CPU_TEST="1", KIT_WIDGETS="1"))]
    codes = wait(procs, 150)
    elapsed = time.monotonic() - t0
    for name, code in zip(("node0_iowa.ipynb", "node1_oregon.ipynb"), codes):
        assert code != 0
        nb = json.loads((tmp_path / name).read_text())
        failed = [c for c in nb["cells"] if c.get("metadata", {}).get("papermill", {}).get("status") == "failed"]
        assert [c["metadata"]["tags"] for c in failed] == [["settings"]], name
        message = cell_text(failed[0])
        assert "MissingSettings" in message and "relay (KIT_RELAY)" in message and "token (KIT_TOKEN)" in message
        widgets = [o for o in failed[0]["outputs"] if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
        assert len(widgets) == (name == "node1_oregon.ipynb")
        later = nb["cells"][nb["cells"].index(failed[0]) + 1:]
        assert all(c.get("execution_count") is None for c in later if c["cell_type"] == "code")
    assert elapsed < 90, f"took {elapsed:.0f} s"  # kernel start and imports, two at once on a busy CI machine


@pytest.mark.timeout(120)
def test_a_cpu_session_is_refused_unless_in_cpu_test_mode(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    p = papermill("node0_iowa.ipynb", tmp_path / "out.ipynb", {}, clean_env())
    assert wait([p], 100) != [0]
    message = cell_text(tagged(tmp_path / "out.ipynb", "environment"))
    assert "No GPU in this session" in message and "GPU T4 x2" in message


def test_settings_resolve_in_the_designed_order(tmp_path):
    from kit.settings import MissingSettings, SettingsError, resolve

    def secrets(name):  # Kaggle Secrets as this notebook would see them
        return {"KIT_RELAY": "secret:1", "KIT_SESSION": "secret-session", "KIT_K": "5", "KIT_TARGET": "secret/t"}.get(name)

    env = {"KIT_RELAY": "env:1", "KIT_SESSION": "env-session", "KIT_PROMPTS": "first\nsecond", "KIT_CPU_TEST": "yes"}
    form = {"relay": "form:1", "session": "form-session", "target": "form/t", "draft": "form-d", "token": "tok-secret-1"}
    s = resolve({"relay": "param:1", "k": None}, defaults={"stage": 0}, env=env, secret=secrets, widgets=form)
    assert (s.relay, s.sources["relay"]) == ("param:1", "parameters")
    assert (s.session, s.sources["session"]) == ("env-session", "environment")
    assert (s.k, s.sources["k"]) == (5, "Kaggle Secrets") and (s.target, s.sources["target"]) == ("secret/t", "Kaggle Secrets")
    assert (s.draft, s.sources["draft"]) == ("form-d", "form")
    assert (s.max_new_tokens, s.sources["max_new_tokens"]) == (256, "default")
    assert s.prompts == ["first", "second"] and s.cpu_test is True and s.missing == []
    assert s.token == "tok-secret-1" and "tok-secret-1" not in s.table()  # shown masked

    card = tmp_path / "card.json"
    card.write_text(json.dumps({"relay": "card:1", "token": "card-token", "fingerprint": "SHA256:aa", "session": "c"}))
    s = resolve({}, defaults={"stage": 1}, env={"KIT_RELAY_CARD": str(card), "KIT_FINGERPRINT": "SHA256:bb"},
                secret=lambda n: None)
    assert (s.relay, s.token, s.fingerprint, s.session) == ("card:1", "card-token", "SHA256:bb", "c")  # gaps only
    assert "prompts" not in s.values and "draft" not in s.values  # node 0's settings are not node 1's

    s = resolve({}, defaults={"stage": 0}, env={}, secret=lambda n: None)
    with pytest.raises(MissingSettings, match=r"relay \(KIT_RELAY\), token \(KIT_TOKEN\)"):
        s.require()
    with pytest.raises(SettingsError, match="k .environment. must be a number"):
        resolve({}, env={"KIT_K": "many"}, secret=lambda n: None)


def test_the_form_fills_missing_settings_on_connect():
    import socket

    from kit import notebook
    from kit.settings import resolve

    params = {"target": "p/t"}
    with socket.create_server(("127.0.0.1", 0)) as listener:
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        current = resolve(params, defaults={"stage": 0}, env={"KIT_SESSION": "env-s"}, secret=lambda n: None)
        assert current.missing == ["relay", "token"]
        form = notebook.show_form(current, lambda values: resolve(params, defaults={"stage": 0}, widgets=values,
                                                                  env={"KIT_SESSION": "env-s"}, secret=lambda n: None))
        boxes = {b.description: b for b in form.children if hasattr(b, "description") and b.description}
        assert boxes["session"].disabled and boxes["target"].disabled  # set by stronger sources
        assert type(boxes["token"]).__name__ == "Password"
        boxes["relay"].value, boxes["token"].value = address, "typed-token"
        boxes["Connect"].click()
    assert current.missing == [] and (current.relay, current.token) == (address, "typed-token")
    assert current.sources["relay"] == "form" and current.session == "env-s"
