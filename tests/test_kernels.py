"""The drafter's Triton kernels (kit/kernels.py), run by Triton's interpreter on CPU (GPU runs:
tests/test_gpu.py and bench/draft_verify.py). Drafts must equal the PyTorch drafter's for each family
(q/k/v bias, Qwen3's q/k norm, Llama-3 rope scaling, tied and untied heads) in fp32 and fp16, over
contexts that span several attention blocks, after a partly and after a fully accepted round; and with
the MLP and head read as int8, equal to the PyTorch drafter on the same rounded weights."""
from __future__ import annotations

import pytest
import torch

from conftest import make_tiny
from kit.draft import ModelDrafter
from kit.load import load_stage

pytest.importorskip("triton")
from kit import kernels  # noqa: E402

torch.set_grad_enabled(False)
MAX_LEN = 320


def pair(path, dtype, int8: bool = False) -> tuple[ModelDrafter, ModelDrafter]:
    """The same checkpoint twice (each drafter owns its cache): PyTorch ops, then the kernels; with int8
    both stages are rounded to int8, and only the kernels read the int8 copies."""
    stages = [load_stage(str(path), 0, 2, dtype=dtype, max_len=MAX_LEN, progress=False) for _ in range(2)]
    if int8:
        stages[0].fuse()
        kernels.quantize_int8(stages[0])
    ref = ModelDrafter(stages[0], 256, graphs=False, kernels=False)
    fast = ModelDrafter(stages[1], 256, graphs=False, kernels=True, int8=int8)
    assert fast.kernels and not ref.kernels and fast.int8 == int8
    return ref, fast


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,tie,dtype,int8", [
    ("qwen2", True, torch.float32, False), ("qwen3", False, torch.float32, False),
    ("llama3", False, torch.float16, False), ("mistral", True, torch.float16, False),
    ("qwen2", True, torch.float32, True), ("llama3", False, torch.float16, True)])
def test_kernel_drafts_equal_pytorch_drafts(tmp_path, family, tie, dtype, int8):
    ref, fast = pair(make_tiny(tmp_path / family, family, tie=tie, layers=2, seed=5), dtype, int8)
    g = torch.Generator().manual_seed(6)
    context = torch.randint(3, 256, (150,), generator=g).tolist()  # > 128 slots: two attention blocks
    drafts = ref.propose(context, 4)
    assert fast.propose(context, 4) == drafts
    partly = context + drafts[:2] + [(drafts[2] + 1) % 256]  # two accepted, then a correction
    assert fast.propose(partly, 3) == ref.propose(partly, 3)
    full = partly + ref.propose(partly, 3) + [9]  # all accepted plus a bonus: the last draft is fed first
    fast.propose(partly, 3)
    assert fast.propose(full, 4) == ref.propose(full, 4)


def test_kernels_decline_what_they_do_not_tile(tmp_path):
    """A head size the kernels do not tile, or bf16 (not verified), keeps the PyTorch step."""
    path = make_tiny(tmp_path / "odd", "llama3", layers=1, hidden=48)  # head_dim 12
    stage = load_stage(str(path), 0, 1, max_len=64, progress=False)
    assert not kernels.available(stage)
    d = ModelDrafter(stage, 256, graphs=False, kernels=True)
    assert not d.kernels and len(d.propose([5, 6, 7], 2)) == 2
    bf16 = load_stage(str(make_tiny(tmp_path / "bf16", "qwen2", layers=1)), 0, 1, dtype=torch.bfloat16, max_len=64,
                      progress=False)
    assert not kernels.available(bf16)


def test_int8_rounding_is_per_row_and_shared_with_the_pytorch_weights(tmp_path):
    """Each MLP and head row becomes int8 times its own scale, off by at most half a step from the
    original; the fp16 weights PyTorch ops read are set to exactly those values. A drafter asked for no
    int8 keeps its weights."""
    path = make_tiny(tmp_path / "q", "qwen2", tie=True, layers=2, seed=3)
    before = load_stage(str(path), 0, 2, dtype=torch.float16, max_len=64, progress=False)
    stage = load_stage(str(path), 0, 2, dtype=torch.float16, max_len=64, progress=False)
    d = ModelDrafter(stage, 256, graphs=False, kernels=True, int8=True)
    assert d.int8
    pairs = [(stage.layers[i].mlp.int8[n], w(before.layers[i].mlp), w(stage.layers[i].mlp))
             for i in range(2) for n, w in (("gate_up", lambda m: m.gate_up[0] if m.gate_up else
                                             torch.cat([m.gate_proj.weight, m.up_proj.weight])),
                                            ("down", lambda m: m.down_proj.weight))]
    pairs.append((stage.int8["head"], before.lm_head.weight, stage.lm_head.weight))
    for (q, scale), old, new in pairs:
        assert q.dtype == torch.int8 and q.shape == old.shape and scale.shape == (old.shape[0],)
        assert q.abs().amax(1).eq(127).all()  # each row's largest weight uses the full range
        assert ((q.float() * scale[:, None]) - old.float()).abs().le(scale[:, None] / 2 * 1.001).all()
        assert torch.equal(new, (q.float() * scale[:, None]).half())
    other = ModelDrafter(load_stage(str(path), 0, 2, dtype=torch.float16, max_len=64, progress=False), 256,
                         graphs=False, kernels=True)
    assert not other.int8 and getattr(other.stage.layers[0].mlp, "int8", None) is None
