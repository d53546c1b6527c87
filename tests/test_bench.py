"""The benchmark scripts run end to end (speed is measured on GPUs, not here)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def kit(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kit", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def test_bench_lists_its_benchmarks():
    p = kit("bench", "--help")
    assert p.returncode == 0
    for name in ("relay", "draft", "verify", "tiles", "acceptance", "e2e"):
        assert name in p.stdout


@pytest.mark.parametrize("name", ["draft", "tiles"])
def test_gpu_benchmarks_say_they_need_a_gpu(name):
    p = kit("bench", name)
    assert p.returncode == 2 and "needs a CUDA GPU" in p.stderr, p.stderr[-2000:]


@pytest.mark.timeout(600)
def test_e2e_bench_planted_acceptance_and_identical_output(tmp_path):
    out = tmp_path / "e2e.json"
    p = kit("bench", "e2e", "--shape", "tiny", "--configs", "plain,spec,depth2", "--rtt-ms", "20", "--k", "4",
            "--acceptance", "0.9", "--max-new-tokens", "40", "--work", str(tmp_path / "w"), "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["identical_outputs"] and set(d["configs"]) == {"plain", "spec", "depth2"}
    for name, c in d["configs"].items():
        assert [len(r["token_ids"]) for r in c["results"]] == [40, 40]
        assert sum(r["committed"] for r in c["rounds"]) == 80
    # a 0.9 planted acceptance gives (1 - 0.9^5) / 0.1 = 4.1 tokens per round at K = 4; plain gives 1
    assert d["configs"]["plain"]["steady"]["tokens_per_round"] == 1.0
    assert d["configs"]["spec"]["steady"]["tokens_per_round"] > 2.5
    p50 = d["configs"]["spec"]["steady"]["p50"]
    assert len(p50["stage_ms"]) == 2 and p50["non_network_ms"] > 0 and p50["draft_ms"] >= 0
    # "other" split into node 0's send, stage 1's frame-to-compute time, node 0's wake-up, and transit; a
    # bare PING through the same emulated path costs at least the emulated round trip
    assert min(p50["send_ms"], p50["host_ms"], p50["wake_ms"], p50["transit_over_rtt_ms"]) > 0
    assert d["configs"]["spec"]["ping_ms"]["1"] >= 20
    assert 0 < p50["beyond_path_ms"] < p50["non_network_ms"]  # the PING's trip is longer than the emulated rtt
    # device times (CUDA events) are recorded per round; on CPU there are none, and no median is made of them
    assert all(r["draft_gpu_ms"] is None and r["stage_gpu_ms"] == [None, None] for r in d["configs"]["spec"]["rounds"])
    assert "stage_gpu_ms" not in p50 and "floor_ratio" not in d["configs"]["spec"]["steady"]
    # overlap: rounds whose drafts were made while the round before was on the wire only take them
    hidden, drafted = d["configs"]["spec"]["steady"]["predrafted"], d["configs"]["spec"]["steady"]["drafted"]
    assert hidden["rounds"] > 0 and drafted["rounds"] > 0
    assert hidden["draft_ms_p50"] < drafted["draft_ms_p50"] / 2
    assert d["configs"]["depth2"]["steady"]["predrafted"]["rounds"] == 0
    # the prompt runs twice (warm-up, then measured): steady rounds are the second pass's only
    spec = d["configs"]["spec"]
    assert len(spec["results"]) == 2 and spec["results"][0]["token_ids"] == spec["results"][1]["token_ids"]
    assert spec["steady"]["rounds"] + spec["steady"]["excluded_rounds"] == sum(
        r["prompt"] == 1 for r in spec["rounds"])
    assert {"command", "hardware", "versions", "floors"} <= set(d)



@pytest.mark.timeout(600)
def test_e2e_runner_up_branches_hide_drafting_where_the_full_guess_fails(tmp_path):
    """Planted: where the drafter's top token is wrong, the target's is its second. With runner-up
    branches drafted while a round is out, most rounds find their drafts ready; with only the
    full-acceptance guess few do; the answers are the same."""
    out = tmp_path / "e2e.json"
    p = kit("bench", "e2e", "--shape", "tiny", "--configs", "spec,no-branches", "--rtt-ms", "60", "--k", "4",
            "--acceptance", "0.7", "--runner-up", "1", "--max-new-tokens", "40", "--work", str(tmp_path / "w"),
            "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["identical_outputs"] and d["acceptance"] == "planted 0.7, runner-up 1.0"
    spec, full_only = d["configs"]["spec"]["steady"], d["configs"]["no-branches"]["steady"]
    assert spec["branches_per_round"] > 1 and full_only["branches_per_round"] == 0
    assert all(r["branches"] == 0 for r in d["configs"]["no-branches"]["rounds"])
    # 0.7^5 = 17% of rounds are fully accepted at K = 4; the branches cover the other rejections
    assert full_only["predrafted"]["rounds"] <= 0.4 * full_only["rounds"]
    assert spec["predrafted"]["rounds"] >= 0.5 * spec["rounds"]
    assert spec["predrafted"]["draft_ms_p50"] < spec["drafted"]["draft_ms_p50"] / 2


def test_runner_up_rates_are_measured_against_the_targets_answer(tmp_path):
    """bench/acceptance.py's teacher-forced rates: a drafter that is the target itself agrees on every
    answer token; one that is not disagrees somewhere and its runner-up rate is a share."""
    import torch
    from conftest import make_tiny

    from bench.acceptance import runner_up
    from kit.draft import NoDrafter, make_drafter
    from kit.generate import generate
    from kit.graphs import StageRunner
    from kit.load import load_stage

    folder = make_tiny(tmp_path / "t", "qwen2", vocab=256, layers=4, hidden=64)
    torch.manual_seed(0)
    target = load_stage(str(folder), 0, 4, progress=False, max_len=128)
    prompt = [5, 17, 33, 2, 90]
    answer = generate([StageRunner(target)], NoDrafter(), prompt, max_new_tokens=24).token_ids
    itself = runner_up(make_drafter(str(folder), str(folder), max_len=128, progress=False), prompt, answer)
    assert itself == {"top1_agreement": 1.0, "runner_up_when_wrong": None}
    shallow = runner_up(make_drafter("self:1", str(folder), target, max_len=128, progress=False), prompt, answer)
    assert shallow["top1_agreement"] < 1.0 and 0.0 <= shallow["runner_up_when_wrong"] <= 1.0
    assert runner_up(NoDrafter(), prompt, answer) is None
