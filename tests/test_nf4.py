"""NF4 loading (bitsandbytes): the decoder's linear layers become 4-bit, the rest stays full precision,
and the stage computes exactly the model whose linear weights are the dequantised NF4 ones."""
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

bnb = pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    # bitsandbytes' CPU kernels want output sizes that are multiples of 32
    return make_tiny(tmp_path_factory.mktemp("nf4") / "m", "qwen2", vocab=256, layers=4, hidden=128, intermediate=256)


def dequantised_copy(stage) -> None:
    """Replace every NF4 layer of `stage` by a plain Linear holding its dequantised weight."""
    for layer in stage.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, q in list(parent.named_children()):
                if isinstance(q, bnb.nn.Linear4bit):
                    w = bnb.functional.dequantize_4bit(q.weight.data, q.weight.quant_state).float()
                    lin = torch.nn.Linear(q.in_features, q.out_features, bias=q.bias is not None)
                    lin.weight.data.copy_(w)
                    if q.bias is not None:
                        lin.bias.data.copy_(q.bias.data)
                    setattr(parent, name, lin)


def test_nf4_stage_is_the_dequantised_model(ckpt):
    full = load_stage(str(ckpt), 0, 4, progress=False, max_len=64)
    nf4 = load_stage(str(ckpt), 0, 4, progress=False, max_len=64, load_in_4bit=True)
    linears = [m for m in nf4.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linears) == 4 * 7  # q, k, v, o, gate, up, down in each layer
    assert isinstance(nf4.embed_tokens, torch.nn.Embedding) and nf4.lm_head.weight.dtype == torch.float32
    size = lambda s: sum(p.numel() * p.element_size() for p in s.layers.parameters())  # noqa: E731
    assert size(nf4) < 0.2 * size(full)  # 4 bits instead of 32 for the linear weights
    ids = torch.tensor([5, 6, 7, 8, 9, 10, 11])
    got = nf4.step(ids)
    ref = load_stage(str(ckpt), 0, 4, progress=False, max_len=64, load_in_4bit=True)
    dequantised_copy(ref)
    want = ref.step(ids)
    # bitsandbytes' CPU kernel multiplies in bf16: ~1% of the logits' range, against ~30% for the
    # quantisation itself, which shows the stage runs the NF4 weights and nothing else
    err = (got - want).abs().max()
    assert err < 0.03 * want.abs().max()
    assert (got - full.step(ids)).abs().max() > 5 * err


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
