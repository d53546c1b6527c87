"""The GPU fast path's pieces on CPU: joined projections, the compiled (traced) pass and draft step
with their dynamic attention span, the two-stage argmax, the span rule."""
from __future__ import annotations

import pytest
import torch

from conftest import make_tiny
from kit.draft import ModelDrafter, argmax
from kit.graphs import StageRunner, span
from kit.load import load_stage

torch.set_grad_enabled(False)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("qwen2"), "qwen2", tie=True, layers=2)


def stage_of(path, max_len: int = 64):
    return load_stage(str(path), 0, 2, max_len=max_len, progress=False)


def test_fuse_keeps_names_values_and_memory(qwen2):
    stage = stage_of(qwen2)
    ids = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(0))
    want = stage.step(ids)
    before = {n: p.clone() for n, p in stage.named_parameters()}
    assert stage.fuse() and stage.fuse()  # idempotent
    after = dict(stage.named_parameters())
    assert after.keys() == before.keys()
    assert all(torch.equal(after[n], before[n]) for n in before)
    for layer in stage.layers:
        joint, bias = layer.self_attn.qkv
        assert layer.self_attn.k_proj.weight.untyped_storage().data_ptr() == joint.untyped_storage().data_ptr()
        assert bias is not None and layer.self_attn.v_proj.bias.untyped_storage().data_ptr() == bias.untyped_storage().data_ptr()
        assert layer.mlp.up_proj.weight.untyped_storage().data_ptr() == layer.mlp.gate_up[0].untyped_storage().data_ptr()
    stage.rewind(0)
    got = stage.step(ids)
    assert (got - want).abs().max().item() <= 1e-5


def counting_backend(graphs: list):
    """torch.compile backend that runs the traced graph as is and counts compilations."""
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return backend


@pytest.mark.timeout(180)
def test_traced_pass_matches_eager_and_spans_share_one_graph(qwen2):
    """What the GPU path compiles: the runner's pass (T = 4 and T = 1) over
    attention spans 16 and 32 of a 64-slot cache, traced whole; one graph per T, shared by the spans."""
    torch._dynamo.reset()
    stage = stage_of(qwen2)
    stage.step(torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(1)))
    stage.fuse()
    runner = StageRunner(stage, graphs=False)
    graphs = []
    traced = torch.compile(runner._pass, backend=counting_backend(graphs), fullgraph=True, dynamic=False)
    for T in (4, 1):
        x = torch.randint(3, 256, (T,), generator=torch.Generator().manual_seed(T))
        for S in (16, 32):
            slots = torch.arange(S)
            torch._dynamo.maybe_mark_dynamic(slots, 0)
            got = traced(x, torch.tensor([12]), slots)
            stage.rewind(12)
            want = stage.step(x)
            assert (got - want).abs().max().item() <= 1e-5, (T, S)
    assert len(graphs) == 2


@pytest.mark.timeout(180)
def test_traced_draft_step_drafts_like_eager(qwen2):
    torch._dynamo.reset()
    stage = stage_of(qwen2)
    stage.fuse()
    eager = ModelDrafter(stage, 256, graphs=False)
    context = torch.randint(3, 256, (15,), generator=torch.Generator().manual_seed(2)).tolist()
    want = eager.propose(context, 5)
    traced = ModelDrafter(stage, 256, graphs=False)
    traced._step_fn = torch.compile(traced._step, backend=counting_backend([]), fullgraph=True, dynamic=False)
    assert traced.propose(context, 5) == want
    assert traced.propose(context + want, 3) == eager.propose(context + want, 3)


def test_two_stage_argmax_is_torch_argmax():
    g = torch.Generator().manual_seed(3)
    for n in (1, 7, 1024, 1025, 3000, 151936):
        x = torch.randn(n, generator=g)
        x[torch.randint(0, n, (3,), generator=g)] = x.max() + 1  # ties: the first one wins
        assert argmax(x).tolist() == [x.argmax().item()], n
    x = torch.full((2000,), float("-inf"))
    x[1500] = 0
    assert argmax(x).tolist() == [1500]


def test_span_is_a_power_of_two_that_holds_the_chain():
    assert [span(n, 4096) for n in (1, 256, 257, 512, 513, 2049, 4096)] == [256, 256, 512, 512, 1024, 4096, 4096]
    assert span(100, 128) == 128 and span(5, 64) == 64
