"""CUDA graphs give what eager gives, replay after replay (skipped without a GPU; CI has none).

Both bugs these tests pin down were invisible to the random-weight benchmarks, whose planted greedy map
ignores the context, and showed on real weights (SmolLM2 on an H200) as answers that went wrong after
a few tokens:
- a tensor the graph reads (the attention slot index) was freed after capture, so once the allocator
  handed its memory out again, later replays masked attention with whatever was written there;
- torch's default capture stream belongs to the device that captured first, so a graph captured for a
  second GPU in the same process recorded nothing.
"""
from __future__ import annotations

import time

import pytest
import torch

from conftest import make_tiny
from kit.draft import ModelDrafter
from kit.graphs import StageRunner
from kit.load import load_stage

torch.set_grad_enabled(False)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_LEN = 512


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny(tmp_path_factory.mktemp("gpu") / "m", "qwen2", layers=4, seed=1))


def churn(device: str) -> None:
    """Allocate and fill many small blocks, as the node does between rounds."""
    junk = [torch.full((n,), 7, device=device, dtype=torch.long) for n in (1, 8, 64, 256, 512) * 20]
    del junk


def decode(runners: list[StageRunner], prompt: list[int], n: int, between=None) -> tuple[list[int], list[torch.Tensor]]:
    h = torch.tensor(prompt[:-1], device=runners[0].device)
    for r in runners:
        h = r.stage.step(h.to(r.device), head=False)
    last, start, tokens, logits = prompt[-1], len(prompt) - 1, [], []
    for _ in range(n):
        x = torch.tensor([last], device=runners[0].device)
        for r in runners:
            x = r(x.to(r.device), start)
        logits.append(x[0, -1].float().cpu())
        last = int(x[0, -1].argmax())
        tokens.append(last)
        start += 1
        if between:
            between()
    return tokens, logits


def stages(tiny: str, devices: list[str]) -> list:
    cut = [(0, 2), (2, 4)] if len(devices) == 2 else [(0, 4)]
    return [load_stage(tiny, a, b, layer_devices=[d] * (b - a), max_len=MAX_LEN, progress=False)
            for (a, b), d in zip(cut, devices)]


PROMPT = [5, 17, 33, 9, 100, 7, 40, 41, 42]


def test_graph_replays_at_new_positions_equal_eager(tiny):
    eager_tokens, eager_logits = decode([StageRunner(s, graphs=False) for s in stages(tiny, ["cuda:0"])], PROMPT, 16)
    runners = [StageRunner(s, graphs=True) for s in stages(tiny, ["cuda:0"])]
    tokens, logits = decode(runners, PROMPT, 16, between=lambda: churn("cuda:0"))
    assert len(runners[0]._captured) == 1  # one graph, replayed at 16 positions
    assert tokens == eager_tokens
    for a, b in zip(logits, eager_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_stage_on_the_second_gpu_is_captured_there(tiny):
    eager_tokens, _ = decode([StageRunner(s, graphs=False) for s in stages(tiny, ["cuda:0", "cuda:1"])], PROMPT, 12)
    runners = [StageRunner(s, graphs=True) for s in stages(tiny, ["cuda:0", "cuda:1"])]
    tokens, _ = decode(runners, PROMPT, 12, between=lambda: (churn("cuda:0"), churn("cuda:1")))
    assert tokens == eager_tokens


@pytest.mark.parametrize("device", ["cuda:0", "cuda:1"])
def test_drafter_graph_equals_eager_across_rounds(tiny, device):
    """Draft rounds at growing positions, each after a partial or full acceptance (the full one feeds
    the last draft inside the graph), equal an eager drafter's."""
    if int(device[-1]) >= torch.cuda.device_count():
        pytest.skip("needs two GPUs")
    if device != "cuda:0":  # a stage graph on cuda:0 captured first, as on a 2-GPU notebook
        StageRunner(stages(tiny, ["cuda:0"])[0], graphs=True)(torch.tensor(PROMPT, device="cuda:0"), 0)
    made = [ModelDrafter(load_stage(tiny, 0, 4, layer_devices=[device] * 4, max_len=MAX_LEN, progress=False),
                         vocab_limit=256, graphs=g) for g in (False, True)]
    for d in made:
        context, d.rounds = list(PROMPT), []
        for i in range(8):
            drafts = d.propose(context, 4)
            d.rounds.append(drafts)
            accepted = 4 if i % 2 else i % 3  # alternate full and partial acceptance
            context += drafts[:accepted] + [(drafts[accepted - 1] + 1) % 256 if accepted else 3]
            churn(device)
    assert made[1].rounds == made[0].rounds


def test_device_clocks_time_the_work_they_wrap(tiny):
    """The CUDA-event clocks that split a round's compute from its host share: positive, and never more
    than the host's wall time around the same call (which also waits for it)."""
    runner = StageRunner(stages(tiny, ["cuda:0"])[0], graphs=True)
    drafter = ModelDrafter(load_stage(tiny, 0, 4, layer_devices=["cuda:0"] * 4, max_len=MAX_LEN, progress=False),
                           vocab_limit=256, graphs=True)
    assert drafter.propose(PROMPT, 0) == [] and drafter.clock.ms() is None  # no drafts, no device time
    x = torch.tensor(PROMPT)
    for _ in range(2):  # the first call captures
        t = time.perf_counter()
        runner(x, 0)
        torch.cuda.synchronize()
        stage_wall = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        drafter.propose(PROMPT, 4)
        draft_wall = (time.perf_counter() - t) * 1000
    assert 0 < runner.clock.ms() <= stage_wall
    assert 0 < drafter.clock.ms() <= draft_wall
    drafter.propose(PROMPT, 0)
    assert drafter.clock.ms() is None  # an empty draft does not report the one before it


def test_branches_through_the_graphs_equal_eager(tiny):
    """Overlap's runner-up branches on the graph path: each step's top tokens come from the logits the
    graph keeps, branches drafted aside leave the main line as it was, and the round after a branch hit
    (its correction and K drafts fed as catch-up inside the graph) drafts what an eager drafter drafts."""
    eager, graphed = (ModelDrafter(load_stage(tiny, 0, 4, layer_devices=["cuda:0"] * 4, max_len=MAX_LEN,
                                              progress=False), vocab_limit=256, graphs=g) for g in (False, True))
    runs = []
    for d in (eager, graphed):
        context, seen = list(PROMPT), []
        for _ in range(3):
            drafts = d.propose(context, 4)
            ids, _ = d.top(3)
            guess = d.propose(context + drafts, 5)
            seen += [drafts, [row[0] for row in ids], guess]
            with d.aside(len(context), 11):
                branch = context + drafts[:1] + [ids[1][1]]
                branch_drafts = d.propose(branch, 4)
            seen.append(branch_drafts)
            churn("cuda:0")
            context = branch + branch_drafts  # the branch hit and its drafts were all accepted
        runs.append(seen)
    assert runs[1] == runs[0]
    assert all(runs[0][i] == runs[0][i + 1] for i in range(0, len(runs[0]), 4))  # drafts are the top tokens
