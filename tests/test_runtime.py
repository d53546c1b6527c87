"""The distributed runtime: real relay, real WAN emulators, one OS process per stage.

Output must equal single-process target-only decoding whatever the drafter, the number of stages, the
rounds in flight, and whatever faults happen on the way.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import make_tiny
from kit.draft import NoDrafter
from kit.generate import generate
from kit.graphs import StageRunner
from kit.launch import LocalCluster
from kit.load import load_stage
from kit.verify import Sampling

PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"target": make_tiny(root / "target", "qwen2", vocab=256, layers=6, hidden=64),
            "draft": make_tiny(root / "draft", "qwen2", vocab=256, layers=2, hidden=32, seed=7)}


def reference(target: Path, n: int, sampling: Sampling = Sampling()) -> list[int]:
    """Target-only decoding in this process: the answer every distributed run must give."""
    stage = load_stage(str(target), 0, 6, progress=False, max_len=256)
    return generate([StageRunner(stage)], NoDrafter(), PROMPT, max_new_tokens=n, sampling=sampling).token_ids


def run(cluster: LocalCluster, target: Path, *args: str, metrics: Path | None = None,
        fault=None, timeout: float = 120) -> tuple[int, dict | None, str]:
    """Start stages 1..N-1 and stage 0; call fault(cluster, metrics) once node 0 is mid-run."""
    common = cluster.common = ["--target", str(target), "--max-len", "256", "--stage-timeout", "20"]
    for i in range(1, cluster.n):
        cluster.start_stage(i, common)
    cmd = common + ["--prompt-ids", ",".join(map(str, PROMPT)), "--json", "--quiet", *args]
    if metrics:
        cmd += ["--metrics-dir", str(metrics)]
    node0 = cluster.start_stage(0, cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if fault:
        fault(cluster, metrics)
    out, err = node0.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return node0.returncode, json.loads(lines[-1]) if lines else None, err


def rounds_done(metrics: Path) -> int:
    f = metrics / "rounds.jsonl"
    return len(f.read_text().splitlines()) if f.exists() else 0


def wait_rounds(metrics: Path, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while rounds_done(metrics) < n:
        assert time.monotonic() < deadline, f"node 0 did not reach {n} rounds"
        time.sleep(0.05)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stages,draft,depth", [
    (2, "none", 1), (2, "ngram", 1), (2, "self:2", 1), (2, "draft", 1), (2, "target", 3), (2, "target", "adaptive"),
    (3, "draft", 3), (3, "self:1", 3), (3, "ngram", 3),
])
def test_distributed_equals_target_only(models, tmp_path, stages, draft, depth):
    expected = reference(models["target"], 40)
    spec = str(models[draft]) if draft in models else draft
    mode = ["--adaptive-k"] if depth == "adaptive" else ["--depth", str(depth)]
    with LocalCluster(stages, tmp_path) as cluster:
        code, result, err = run(cluster, models["target"], "--draft", spec, "--k", "4", *mode,
                                "--max-new-tokens", "40", metrics=tmp_path / "m")
    assert code == 0, err
    assert result["token_ids"] == expected
    assert result["generated_tokens"] == 40 and result["finish_reason"] == "length"
    rows = [json.loads(line) for line in (tmp_path / "m" / "rounds.jsonl").read_text().splitlines()]
    assert sum(r["committed"] for r in rows) == 40 and all(len(r["stage_ms"]) == stages for r in rows)
    # the parts of a round are disjoint stretches of it: draft, stage passes, each later stage's
    # frame-to-compute time, node 0 waking up on the verdict (node 0's send may still be returning while
    # stage 1 already works on the frame, so it only has to fit in the round)
    for r in rows:
        parts = r["draft_ms"] + sum(r["stage_ms"]) + sum(r["host_ms"]) + r["wake_ms"]
        assert len(r["host_ms"]) == stages - 1 and min(r["send_ms"], r["wake_ms"], *r["host_ms"]) > 0
        assert parts <= r["round_ms"] + 0.01 and r["send_ms"] < r["round_ms"], r
    if draft == "target" and depth != "adaptive":  # a perfect drafter: every round commits K + 1 tokens
        assert result["tokens_per_round"] == 5.0
    if depth == "adaptive":  # K is chosen per round, within 1..4, and full acceptance drives it up
        assert all(1 <= r["k"] <= 4 for r in rows) and rows[-2]["k"] >= rows[0]["k"]
    if draft == "target" and depth == "adaptive":  # one round in flight, overlap on, every guess holds:
        # each round after the first was drafted while the one before it was on the wire
        assert [r["predrafted"] for r in rows] == [False] + [True] * (len(rows) - 1)
    if draft == "none" or depth == 3:  # nothing to guess with, or rounds in flight instead of overlap
        assert not any(r["predrafted"] for r in rows)


@pytest.mark.timeout(300)
def test_sampling_same_with_and_without_relay(models, tmp_path):
    s = Sampling(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    single = load_stage(str(models["target"]), 0, 6, progress=False, max_len=256)
    draft = load_stage(str(models["draft"]), 0, 2, progress=False, max_len=256)
    from kit.draft import ModelDrafter
    local = generate([StageRunner(single)], ModelDrafter(draft, 256), PROMPT, max_new_tokens=30, k=3, sampling=s)
    with LocalCluster(2, tmp_path) as cluster:
        code, result, err = run(cluster, models["target"], "--draft", str(models["draft"]), "--k", "3",
                                "--max-new-tokens", "30", "--temperature", "0.9", "--top-p", "0.95",
                                "--top-k", "50", "--seed", "1234", "--depth", "2")
    assert code == 0, err
    assert result["token_ids"] == local.token_ids
    assert result["token_ids"] != reference(models["target"], 30)  # it really sampled


def kill_and_restart(stage: int):
    def fault(cluster: LocalCluster, metrics: Path) -> None:
        wait_rounds(metrics, 5)
        cluster.kill_stage(stage)
        time.sleep(0.5)
        cluster.start_stage(stage, cluster.common)
    return fault


def cut_links(cluster: LocalCluster, metrics: Path) -> None:
    wait_rounds(metrics, 5)
    cluster.cut()


def restart_relay(cluster: LocalCluster, metrics: Path) -> None:
    wait_rounds(metrics, 5)
    cluster.restart_relay()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,fault", [("kill middle", kill_and_restart(1)), ("kill last", kill_and_restart(2)),
                                        ("cut links", cut_links), ("restart relay", restart_relay)])
def test_faults_do_not_change_output(models, tmp_path, name, fault):
    expected = reference(models["target"], 60)
    with LocalCluster(3, tmp_path, rtt_ms=40) as cluster:
        code, result, err = run(cluster, models["target"], "--draft", str(models["draft"]), "--k", "3",
                                "--depth", "2", "--max-new-tokens", "60", metrics=tmp_path / "m", fault=fault)
    assert code == 0, err
    assert result["token_ids"] == expected, name
    summary = json.loads((tmp_path / "m" / "summary.json").read_text())
    if name.startswith("kill"):  # the restarted stage was rebuilt from the committed tokens
        assert summary["replays"] >= 1
    if name == "cut links":
        assert all("cut #" in (tmp_path / f"wan{i}.log").read_text() for i in range(3))


@pytest.mark.timeout(300)
def test_stage_that_never_returns_ends_with_clear_error(models, tmp_path):
    def kill_last(cluster: LocalCluster, metrics: Path) -> None:
        wait_rounds(metrics, 5)
        cluster.kill_stage(1)

    with LocalCluster(2, tmp_path, rtt_ms=40) as cluster:
        code, result, err = run(cluster, models["target"], "--max-new-tokens", "200", "--stage-timeout", "6",
                                metrics=tmp_path / "m", fault=kill_last)
    assert code == 3
    assert "error:" in err and "Traceback" not in err
    saved = json.loads((tmp_path / "m" / "summary.json").read_text())
    assert saved["finish_reason"] == "error"
    expected = reference(models["target"], 200)
    assert 5 <= len(saved["token_ids"]) < 200 and saved["token_ids"] == expected[: len(saved["token_ids"])]


def test_cli_errors_are_one_line(models, tmp_path):
    cases = [
        (["run", "--target", str(tmp_path / "nope"), "--prompt", "hi"], "neither a checkpoint folder"),
        (["run", "--target", str(models["target"]), "--stages", "1", "--prompt", "hi"], "--stages"),
        (["node", "--stage", "0", "--stages", "2", "--target", str(models["target"]), "--prompt-ids", "1"],
         "no relay address"),
    ]
    for argv, needle in cases:
        p = subprocess.run([sys.executable, "-m", "kit", *argv], capture_output=True, text=True, timeout=120,
                           cwd=Path(__file__).resolve().parents[1])
        assert p.returncode != 0 and needle in p.stderr and "Traceback" not in p.stderr, (argv, p.stderr)


@pytest.mark.timeout(300)
def test_restarted_node0_drives_the_same_stages(models, tmp_path):
    """A notebook 0 that restarts mid-answer (its stages still serving) gives the same answer again."""
    expected = reference(models["target"], 60)
    with LocalCluster(3, tmp_path, rtt_ms=40) as cluster:
        common = ["--target", str(models["target"]), "--max-len", "256", "--stage-timeout", "20"]
        for i in (1, 2):
            cluster.start_stage(i, common)
        args = common + ["--draft", "ngram", "--k", "3", "--max-new-tokens", "60", "--json", "--quiet",
                         "--prompt-ids", ",".join(map(str, PROMPT)), "--metrics-dir", str(tmp_path / "m")]
        first = cluster.start_stage(0, args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_rounds(tmp_path / "m", 5)
        cluster.kill_stage(2)  # a replay first, so the stages have seen a later generation than a fresh node 0's first
        cluster.start_stage(2, common)
        wait_rounds(tmp_path / "m", 15)
        first.kill()
        first.communicate()
        again = cluster.start_stage(0, args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = again.communicate(timeout=200)
    assert again.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["token_ids"] == expected


@pytest.mark.timeout(300)
def test_demo_runs_speculative_and_plain_with_identical_answers(smol_dir):
    """README's first command, shortened: SmolLM2 over 2 stage processes, the relay and emulated WAN links."""
    p = subprocess.run([sys.executable, "-m", "kit", "demo", "--max-new-tokens", "24", "--json"], capture_output=True,
                       text=True, timeout=280, cwd=Path(__file__).resolve().parents[1])
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(p.stdout.strip().splitlines()[-1])
    spec, plain = d["speculative"], d["plain"]
    assert d["identical"] and spec["token_ids"] == plain["token_ids"] and len(spec["token_ids"]) == 24
    assert plain["tokens_per_round"] == 1.0 and spec["tokens_per_round"] > 1.0  # the answer repeats the prompt
    assert spec["text"].strip()
