"""NF4 loading (bitsandbytes): the decoder's linear layers become 4-bit, the rest stays full precision,
and the stage computes exactly the model whose linear weights are the dequantised NF4 ones; a round's few
tokens go through kit.nf4's Triton kernel (Triton's interpreter here, tests/test_gpu.py on a GPU)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import make_tiny
from kit.draft import NoDrafter
from kit.generate import generate
from kit.graphs import StageRunner
from kit.launch import LocalCluster
from kit.load import load_stage
from kit.nf4 import MAX_T, NF4Linear, matmul

bnb = pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    # bitsandbytes' CPU kernels want output sizes that are multiples of 32
    return make_tiny(tmp_path_factory.mktemp("nf4") / "m", "qwen2", vocab=256, layers=4, hidden=128, intermediate=256)


def dequantised(q) -> torch.Tensor:
    return bnb.functional.dequantize_4bit(q.weight.data, q.weight.quant_state).float()


def dequantised_copy(stage) -> None:
    """Replace every NF4 layer of `stage` by a plain Linear holding its dequantised weight."""
    for layer in stage.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, wrapped in list(parent.named_children()):
                if isinstance(wrapped, NF4Linear):
                    q = wrapped.q
                    lin = torch.nn.Linear(q.in_features, q.out_features, bias=q.bias is not None)
                    lin.weight.data.copy_(dequantised(q))
                    if q.bias is not None:
                        lin.bias.data.copy_(q.bias.data)
                    setattr(parent, name, lin)


def nf4_layer(n: int, k: int, bias: bool, nested: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = bnb.nn.Linear4bit(k, n, bias=bias, compute_dtype=torch.float32, quant_type="nf4", device="meta")
    q.weight = bnb.nn.Params4bit(torch.randn(n, k, generator=g), requires_grad=False, quant_type="nf4",
                                 compress_statistics=nested)
    if bias:
        q.bias = torch.nn.Parameter(torch.randn(n, generator=g), requires_grad=False)
    return q.to("cpu")


@pytest.mark.parametrize("n,k,bias,nested", [(96, 256, True, True), (40, 192, False, True), (64, 128, True, False),
                                             (1100, 64, False, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_kernel_multiplies_by_the_dequantised_weight(n, k, bias, nested, dtype):
    """Rows past a block of features, K tiles of 256/128/64, scales nested or not (and, at 1100 x 64, more
    than 256 scale blocks, so the second-level scale changes), for 1, 9 and 16 tokens."""
    q = nf4_layer(n, k, bias, nested, seed=n)
    assert q.weight.quant_state.nested == nested
    w = dequantised(q)
    for T in (1, 9, MAX_T):
        x = torch.randn(1, T, k, generator=torch.Generator().manual_seed(T)).to(dtype)
        want = torch.nn.functional.linear(x.float(), w.to(dtype).float(), q.bias)  # bitsandbytes' rounding
        got = matmul(x, q)
        assert got.shape == (1, T, n) and got.dtype == dtype
        tol = 1e-4 if dtype == torch.float32 else 2e-3
        assert (got.float() - want).abs().max() <= tol * want.abs().max(), (T, dtype)


def test_a_prompt_goes_through_bitsandbytes_and_a_round_through_the_kernel():
    q = nf4_layer(64, 128, True, True, seed=1)
    layer = NF4Linear(q)
    g = torch.Generator().manual_seed(0)
    round_x, prompt_x = torch.randn(1, 9, 128, generator=g), torch.randn(1, MAX_T + 1, 128, generator=g)
    assert torch.equal(layer(round_x), matmul(round_x, q)) and layer.fast
    assert torch.equal(layer(prompt_x), q(prompt_x))


def test_nf4_stage_is_the_dequantised_model(ckpt):
    full = load_stage(str(ckpt), 0, 4, progress=False, max_len=64)
    nf4 = load_stage(str(ckpt), 0, 4, progress=False, max_len=64, load_in_4bit=True)
    linears = [m for m in nf4.modules() if isinstance(m, NF4Linear) and isinstance(m.q, bnb.nn.Linear4bit)]
    assert len(linears) == 4 * 7  # q, k, v, o, gate, up, down in each layer
    assert isinstance(nf4.embed_tokens, torch.nn.Embedding) and nf4.lm_head.weight.dtype == torch.float32
    size = lambda s: sum(p.numel() * p.element_size() for p in s.layers.parameters())  # noqa: E731
    assert size(nf4) < 0.2 * size(full)  # 4 bits instead of 32 for the linear weights
    ids = torch.tensor([5, 6, 7, 8, 9, 10, 11])
    got = nf4.step(ids)
    ref = load_stage(str(ckpt), 0, 4, progress=False, max_len=64, load_in_4bit=True)
    dequantised_copy(ref)
    want = ref.step(ids)
    # seven tokens take the kernel (fp32 here): rounding only, against ~30% of the logits' range for the
    # quantisation itself, which shows the stage runs the NF4 weights and nothing else
    err = (got - want).abs().max()
    assert err < 1e-4 * want.abs().max()
    assert (got - full.step(ids)).abs().max() > 0.05 * want.abs().max()
    # a prompt goes through bitsandbytes, whose CPU kernel multiplies in bf16: ~1% of the range
    prompt = torch.arange(3, 3 + MAX_T + 4)
    nf4.rewind(0)
    ref.rewind(0)
    assert (nf4.step(prompt) - ref.step(prompt)).abs().max() < 0.03 * want.abs().max()


@pytest.mark.timeout(300)
def test_nf4_ring_equals_nf4_target_only(ckpt, tmp_path):
    stage = load_stage(str(ckpt), 0, 4, progress=False, max_len=128, load_in_4bit=True)
    prompt = [5, 6, 7, 8, 9]
    expected = generate([StageRunner(stage)], NoDrafter(), prompt, max_new_tokens=24).token_ids
    with LocalCluster(2, tmp_path) as cluster:
        common = ["--target", str(ckpt), "--max-len", "128", "--load-in-4bit"]
        cluster.start_stage(1, common)
        node0 = cluster.start_stage(0, common + ["--draft", "ngram", "--k", "3", "--max-new-tokens", "24",
                                                 "--prompt-ids", "5,6,7,8,9", "--json", "--quiet"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = node0.communicate(timeout=240)
    assert node0.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["token_ids"] == expected
