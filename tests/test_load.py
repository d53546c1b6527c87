"""Shard loading: a stage reads only its own shard files and tensors, stays near its own size in host
memory, turns every kind of bad input into one clear error, and resolves GGUF files and hub ids."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import ROOT, make_tiny
from kit.load import CheckpointError, load_config, load_stage, parse_dtype, resolve, smollm2_gguf
from kit.model import ConfigError



@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


MiB = 1 << 20


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A 6-layer Qwen2 checkpoint saved by `transformers` in 100 KB shards (two or so per layer)."""
    from transformers import AutoModelForCausalLM

    src = make_tiny(tmp_path_factory.mktemp("src"), "qwen2", layers=6)
    out = tmp_path_factory.mktemp("sharded")
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).save_pretrained(out, max_shard_size="100KB")
    return out


def weight_map(folder: Path) -> dict[str, str]:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


def copy_of(folder: Path, dest: Path) -> Path:
    return Path(shutil.copytree(folder, dest))


def test_middle_stage_reads_only_its_shards(sharded, tmp_path):
    wmap = weight_map(sharded)
    shards = set(wmap.values())
    needed = sorted({f for n, f in wmap.items() if n.startswith(("model.layers.2.", "model.layers.3."))})
    assert len(shards) >= 4 and 0 < len(needed) < len(shards)
    # the boundary shards also hold tensors of layers 1 and 4, which the stage must not take
    assert any(n.startswith("model.layers.1.") for n, f in wmap.items() if f in needed)
    folder = copy_of(sharded, tmp_path / "ckpt")
    for f in shards - set(needed):
        (folder / f).unlink()

    stage = load_stage(str(folder), 2, 4, progress=False, max_len=32)
    assert stage.loaded_files == needed
    assert not stage.first and not stage.last
    assert not hasattr(stage, "embed_tokens") and not hasattr(stage, "lm_head")
    got = stage.state_dict()
    ours = [f"layers.{int(n.split('.')[2]) - 2}.{n.split('.', 3)[3]}" for n in wmap
            if n.startswith(("model.layers.2.", "model.layers.3."))]
    assert sorted(got) == sorted(ours)
    for name, tensor in got.items():
        i, rest = name.split(".", 2)[1:]
        src = f"model.layers.{int(i) + 2}.{rest}"
        with safe_open(sharded / wmap[src], framework="pt") as f:
            assert torch.equal(tensor, f.get_tensor(src)), name

    # and the stage computes what layers 2..3 of the whole model compute
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.float32).eval()
    hidden = hf(torch.tensor([[5, 17, 99, 3, 250, 42]]), output_hidden_states=True).hidden_states
    diff = (stage.step(hidden[2]) - hidden[4]).abs().max().item()
    assert diff <= 1e-4, f"max abs diff {diff:.2e}"

    gone = needed[len(needed) // 2]
    (folder / gone).unlink()
    with pytest.raises(CheckpointError, match=f"shard {gone} is missing"):
        load_stage(str(folder), 2, 4, progress=False, max_len=32)


def write_big(path: Path, layers: int = 10, hidden: int = 768, inter: int = 2048, vocab: int = 8192) -> Path:
    """A ~290 MB fp32 Llama checkpoint of random weights, one shard per layer, written tensor by tensor."""
    heads, kv, hd = hidden // 64, 4, 64
    path.mkdir()
    (path / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, vocab_size=vocab,
        max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-6)))
    g = torch.Generator().manual_seed(0)
    wmap = {}

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, path / name)
        wmap.update(dict.fromkeys(tensors, name))

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    shard("embed.safetensors", {"model.embed_tokens.weight": r(vocab, hidden)})
    for i in range(layers):
        p = f"model.layers.{i}."
        shard(f"layer-{i:02d}.safetensors", {
            p + "input_layernorm.weight": torch.ones(hidden), p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": r(heads * hd, hidden), p + "self_attn.k_proj.weight": r(kv * hd, hidden),
            p + "self_attn.v_proj.weight": r(kv * hd, hidden), p + "self_attn.o_proj.weight": r(hidden, heads * hd),
            p + "mlp.gate_proj.weight": r(inter, hidden), p + "mlp.up_proj.weight": r(inter, hidden),
            p + "mlp.down_proj.weight": r(hidden, inter)})
    shard("head.safetensors", {"model.norm.weight": torch.ones(hidden), "lm_head.weight": r(vocab, hidden)})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return path


# Peak RSS is read from VmHWM, not ru_maxrss: Linux carries the parent's RSS at fork over into the
# child's ru_maxrss, so a child of a big pytest process would measure nothing.
PEAK = r"""
import json, re, sys
import torch
from kit.load import load_stage
torch.set_grad_enabled(False)
def rss():
    status = open("/proc/self/status").read()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024
base = rss()
s = load_stage(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), max_len=16, progress=False)
x = torch.arange(4) if s.first else torch.zeros(1, 4, s.cfg.hidden_size)
s.step(x)  # touch every weight: safetensors may map them lazily
print(json.dumps({"growth": rss() - base, "bytes": sum(p.numel() * p.element_size() for p in s.parameters())}))
"""


def peak_growth(folder: Path, start: int, end: int) -> tuple[int, int]:
    """(growth of peak RSS over the load and one step, the stage's parameter bytes), in a fresh process."""
    r = subprocess.run([sys.executable, "-c", PEAK, str(folder), str(start), str(end)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return out["growth"], out["bytes"]


@pytest.mark.timeout(240)
def test_peak_host_memory_stays_near_the_stage_size(tmp_path):
    folder = write_big(tmp_path / "big")
    try:
        growth, stage_bytes = peak_growth(folder, 4, 6)
        full_growth, full_bytes = peak_growth(folder, 0, 10)
    finally:
        shutil.rmtree(folder)
    bound = 1.3 * stage_bytes + 32 * MiB
    report = (f"stage 4-6: {stage_bytes / MiB:.0f} MiB, peak growth {growth / MiB:.0f} MiB, "
              f"bound {bound / MiB:.0f} MiB; whole model: {full_bytes / MiB:.0f} MiB, "
              f"peak growth {full_growth / MiB:.0f} MiB")
    assert stage_bytes > 45 * MiB and full_bytes > 5 * stage_bytes, report
    assert growth >= stage_bytes, report  # the weights are really in memory (the measurement measures)
    assert growth < bound, report
    assert full_growth > 2 * bound, report  # loading everything would fail the bound by far
    print(report)


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    folder = make_tiny(tmp_path / "m", "llama3", layers=2)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match=r"unsupported architecture 'gpt2'; supported: llama, mistral, qwen2, qwen3"):
        load_stage(str(folder), 0, 2, progress=False)


def test_missing_config_or_weights(tmp_path):
    folder = make_tiny(tmp_path / "m", "mistral", layers=2)
    (folder / "config.json").rename(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_stage(str(folder), 0, 2, progress=False)
    (tmp_path / "config.json").rename(folder / "config.json")
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="holds no model.safetensors nor model.safetensors.index.json"):
        load_stage(str(folder), 0, 2, progress=False)


def test_partial_checkpoint_names_the_missing_tensor(sharded, tmp_path):
    folder = copy_of(sharded, tmp_path / "ckpt")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.3.mlp.up_proj.weight"]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"is partial: missing model\.layers\.3\.mlp\.up_proj\.weight"):
        load_stage(str(folder), 2, 4, progress=False)
    load_stage(str(folder), 0, 2, progress=False, max_len=8)  # a stage that does not need it still loads


def test_untied_checkpoint_without_lm_head_is_partial(tmp_path):
    folder = make_tiny(tmp_path / "m", "qwen3", tie=False, layers=2)
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "lm_head.weight"}
    save_file(tensors, folder / "model.safetensors")
    load_stage(str(folder), 0, 1, progress=False, max_len=8)
    with pytest.raises(CheckpointError, match="is partial: missing lm_head.weight"):
        load_stage(str(folder), 1, 2, progress=False)  # not silently replaced by the embedding


@pytest.mark.parametrize("start,end", [(2, 7), (-1, 2), (3, 3), (5, 4)])
def test_layer_range_outside_the_model(sharded, start, end):
    with pytest.raises(ValueError, match=rf"layer range \[{start}, {end}\) is outside the model's 6 layers"):
        load_stage(str(sharded), start, end, progress=False)


@pytest.mark.parametrize("source,message", [
    ("/no/such/folder", "neither a checkpoint folder, a .gguf file, nor a hub id"),
    ("./no-such-folder", "neither a checkpoint folder"),
    ("a/b/c", "neither a checkpoint folder"),
    ("not a model", "neither a checkpoint folder"),
    ("", "neither a checkpoint folder"),
    ("/no/such/model.gguf", "GGUF file /no/such/model.gguf does not exist"),
])
def test_bad_source(source, message):
    with pytest.raises(CheckpointError, match=message):
        load_stage(source, 0, 1, progress=False)


def test_dtypes(sharded):
    assert parse_dtype("fp16") is parse_dtype("float16") is torch.float16
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("fp32") is torch.float32
    for bad in ("float8", "int4", "FP16", ""):
        with pytest.raises(ValueError, match=rf"unknown dtype '{bad}'; choose from float16, bfloat16, float32"):
            parse_dtype(bad)
    stage = load_stage(str(sharded), 0, 6, dtype=torch.bfloat16, progress=False, max_len=8)
    assert {p.dtype for p in stage.parameters()} == {torch.bfloat16}
    assert stage.k_caches[0].dtype == torch.bfloat16
    assert torch.isfinite(stage.step(torch.tensor([1, 2, 3]))).all()


def test_gguf_resolves_once_to_a_cached_folder(smol_dir):
    gguf = smollm2_gguf()
    folder = resolve(gguf)
    assert folder == smol_dir and (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    stamp = (folder / "config.json").stat().st_mtime_ns
    t = time.perf_counter()
    again = resolve(gguf)
    assert again == folder and time.perf_counter() - t < 1.0
    assert (folder / "config.json").stat().st_mtime_ns == stamp  # reused, not rewritten
    cfg = load_config(gguf)
    assert (cfg.arch, cfg.n_layers, cfg.hidden_size, cfg.tie_embeddings) == ("llama", 30, 576, True)


def test_hub_id_offline_fails_fast_with_one_line(tmp_path):
    code = ("from kit.load import CheckpointError, load_stage\n"
            "try:\n    load_stage('Qwen/Qwen2.5-0.5B', 0, 1, progress=False)\n"
            "except CheckpointError as e:\n    print(e)\n    raise SystemExit(3)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}  # an empty hub cache
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cannot fetch Qwen/Qwen2.5-0.5B from the hub: "), r.stdout
    assert "HF_HUB_OFFLINE" in lines[0]
    assert time.perf_counter() - t < 30
