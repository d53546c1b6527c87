"""The drafter's Triton kernels (kit/kernels.py), run by Triton's interpreter on CPU (GPU runs:
tests/test_gpu.py and bench/draft_verify.py). Drafts must equal the PyTorch drafter's for each family
(q/k/v bias, Qwen3's q/k norm, Llama-3 rope scaling, tied and untied heads) in fp32 and fp16, over
contexts that span several attention blocks, after a partly and after a fully accepted round."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import make_tiny
from kit.draft import ModelDrafter
from kit.load import load_stage

pytest.importorskip("triton")
from kit import kernels  # noqa: E402

torch.set_grad_enabled(False)
MAX_LEN = 320


def pair(path, dtype) -> tuple[ModelDrafter, ModelDrafter]:
    """The same checkpoint twice (each drafter owns its cache): PyTorch ops, then the kernels."""
    stages = [load_stage(str(path), 0, 2, dtype=dtype, max_len=MAX_LEN, progress=False) for _ in range(2)]
    ref = ModelDrafter(stages[0], 256, graphs=False, kernels=False)
    fast = ModelDrafter(stages[1], 256, graphs=False, kernels=True)
    assert fast.kernels and not ref.kernels
    return ref, fast


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,tie,dtype", [("qwen2", True, torch.float32), ("qwen3", False, torch.float32),
                                              ("llama3", False, torch.float16), ("mistral", True, torch.float16)])
def test_kernel_drafts_equal_pytorch_drafts(tmp_path, family, tie, dtype):
    ref, fast = pair(make_tiny(tmp_path / family, family, tie=tie, layers=2, seed=5), dtype)
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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("use_kernels", [False, True])
def test_branches_drafted_aside_leave_the_main_line_as_it_was(tmp_path, use_kernels):
    """Overlap's runner-up branches (kit.node.Driver.draft_branches): `top` ranks what the last draft
    step saw, a branch drafted inside `aside` equals a fresh drafter's draft of it, and afterwards the
    main line drafts exactly as if no branch had been drafted (its cache slots and record restored)."""
    path = make_tiny(tmp_path / "m", "qwen2", layers=2, seed=3)
    main, fresh, never = (ModelDrafter(load_stage(str(path), 0, 2, max_len=MAX_LEN, progress=False), 256,
                                       graphs=False, kernels=use_kernels) for _ in range(3))
    assert main.kernels == use_kernels
    context = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    drafts = main.propose(context, 4)
    ids, logps = main.top(3)
    assert [row[0] for row in ids] == drafts and len(ids) == 4  # greedy drafts are each step's top token
    assert all(row == sorted(row, reverse=True) and row[0] <= 0 for row in logps)
    assert all(sum(math.exp(x) for x in row) <= 1 + 1e-5 for row in logps)
    spec = main.propose(context + drafts, 5)  # overlap's full-acceptance guess
    assert never.propose(context, 4) == drafts and never.propose(context + drafts, 5) == spec
    with main.aside(len(context), 11):
        for a in (4, 2, 0):  # deepest first, as the driver drafts them
            branch = context + drafts[:a] + [ids[a][1] if a < 4 else spec[0] + 1]
            assert main.propose(branch, 4) == fresh.propose(branch, 4)
    assert main.top(3) == ([], [])  # the branches' logits are not the main line's
    partly = context + drafts[:1] + [ids[1][1]]  # then the verdict: one accepted, the runner-up after it
    assert main.propose(partly, 4) == never.propose(partly, 4)
    full = context + drafts + spec  # or a full acceptance, the guess right, and the round after that
    main.propose(context + drafts, 5)
    never.propose(context + drafts, 5)
    assert main.propose(full, 4) == never.propose(full, 4)
