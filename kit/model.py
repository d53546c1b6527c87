"""Compact decoder (Llama, Mistral, Qwen2/2.5, Qwen3) cut into stages, with a static KV cache.

A stage owns a contiguous layer range [start, end), plus the embedding when it is the first and the
final norm and LM head when it is the last. Parameter names follow the Hugging Face checkpoints with
the `model.` prefix dropped and layer indices made local, so loading is a rename.

Shapes: T new tokens, S attended cache slots, D hidden size, H query heads, G kv heads, E head dim.
Batch size is always 1: one conversation per ring.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


class ConfigError(ValueError):
    """A config.json the kit cannot run."""


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        """Read a Hugging Face config.json dict (transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`)."""
        arch = d.get("model_type", "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in d]
        if missing:
            raise ConfigError(f"config.json lacks {', '.join(missing)}")
        rope = dict(d.get("rope_parameters") or {})
        scaling = d.get("rope_scaling") or None
        if scaling:
            rope.update(scaling)
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "linear", "llama3"):
            raise ConfigError(f"unsupported rope type {kind!r}; supported: default, linear, llama3")
        eos = d.get("eos_token_id")
        n_heads = d["num_attention_heads"]
        return cls(
            arch=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            n_layers=d["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=d.get("num_key_value_heads") or n_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // n_heads,
            rms_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if kind == "default" else {**rope, "rope_type": kind},
            qkv_bias=arch == "qwen2" or bool(d.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )


def rope_tables(cfg: ModelConfig, max_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_len, E] in fp32, with linear or Llama-3 frequency scaling."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    sc = cfg.rope_scaling
    if sc and sc["rope_type"] == "linear":
        inv_freq = inv_freq / sc["factor"]
    elif sc and sc["rope_type"] == "llama3":
        factor, lo, hi = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        old = sc.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv_freq / factor, inv_freq)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    t = torch.arange(max_len, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float().to(device), emb.sin().float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [1, heads, T, E]; cos/sin: [T, E]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set by fuse()

    def fuse(self) -> None:
        if self.qkv is None:
            self.qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x, cos, sin, mask, slots, k_cache, v_cache) -> torch.Tensor:
        # x: [1, T, D]; mask: [T, S] bool; slots: [T]; caches: [1, G, max_len, E]
        T = x.shape[1]
        if self.qkv is not None:
            q, k, v = F.linear(x, *self.qkv).split([self.n_heads * self.hd, self.n_kv * self.hd,
                                                    self.n_kv * self.hd], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(1, T, self.n_heads, self.hd)
        k = k.view(1, T, self.n_kv, self.hd)
        v = v.view(1, T, self.n_kv, self.hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [1, heads, T, E]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache.index_copy_(2, slots, k)
        v_cache.index_copy_(2, slots, v)
        S = mask.shape[-1]
        y = attend(q, k_cache[:, :, :S], v_cache[:, :, :S], mask).transpose(1, 2).reshape(1, T, -1)
        return self.o_proj(y)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention of q [1, H, T, E] over k, v [1, G, S, E] where mask [T, S] is True.

    The H/G query heads that share a kv head are stacked as extra query rows, so each kv head is read
    once and never repeated; scores and softmax in fp32, as `transformers`' eager attention does."""
    _, H, T, E = q.shape
    G, S = k.shape[1], k.shape[2]
    scores = (q.reshape(1, G, H // G * T, E) @ k.transpose(2, 3)).float() * E ** -0.5
    scores = scores.view(1, G, H // G, T, S).masked_fill(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1).to(v.dtype).view(1, G, H // G * T, S)
    return (p @ v).view(1, H, T, E)


def fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for linear maps of the same input: one matmul reads them all.

    Each map's parameters become views of the joint tensor, so names, memory and in-place loading
    stay as they were; replacing a parameter object afterwards would not reach the joint tensor."""
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = torch.cat([m.bias.detach() for m in linears]) if linears[0].bias is not None else None
    at = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[at:at + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[at:at + n], requires_grad=False)
        at += n
    return weight, bias


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up: tuple[torch.Tensor, None] | None = None  # set by fuse()

    def fuse(self) -> None:
        if self.gate_up is None:
            self.gate_up = fuse_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = F.linear(x, self.gate_up[0]).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, slots, k_cache, v_cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, slots, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Stage(nn.Module):
    """Layers [start, end) of a model; embedding if first, norm + head if last.

    `layer_devices[i]` places layer i (local index) so one node can spread its layers over its GPUs.
    The KV cache lives beside the modules (not inside them) so a drafter can share this stage's
    weights with a cache of its own.
    """

    def __init__(self, cfg: ModelConfig, start: int, end: int, *, first: bool, last: bool,
                 layer_devices: list[torch.device] | None = None):
        super().__init__()
        if not 0 <= start < end <= cfg.n_layers:
            raise ValueError(f"layer range [{start}, {end}) is outside the model's {cfg.n_layers} layers")
        self.cfg, self.start, self.end, self.first, self.last = cfg, start, end, first, last
        if first:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(end - start))
        if last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.layer_devices = layer_devices
        self.max_len = 0
        self.length = 0  # valid cache length; slots >= length are stale and masked
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].input_layernorm.weight.dtype

    def setup_cache(self, max_len: int) -> None:
        """Preallocate K/V for max_len tokens on each layer's device; nothing allocates cache later."""
        self.max_len, self.length = max_len, 0
        self.k_caches, self.v_caches = [], []
        for layer in self.layers:
            w = layer.input_layernorm.weight
            shape = (1, self.cfg.n_kv_heads, max_len, self.cfg.head_dim)
            self.k_caches.append(torch.zeros(shape, dtype=w.dtype, device=w.device))
            self.v_caches.append(torch.zeros(shape, dtype=w.dtype, device=w.device))
        self.rope = {}  # positions never exceed slots, so max_len rows suffice
        for dev in {w.device for w in (layer.input_layernorm.weight for layer in self.layers)}:
            self.rope[dev] = rope_tables(self.cfg, max_len, dev)

    def rewind(self, n: int) -> None:
        """Forget everything from slot n on: O(1), stale slots are masked and later overwritten."""
        if not 0 <= n <= self.max_len:
            raise ValueError(f"cannot rewind to {n}: cache holds {self.max_len} slots")
        self.length = n

    def fuse(self) -> bool:
        """Join q/k/v and gate/up into one matmul each (fewer, larger kernels on a GPU); the joined
        layers then multiply by the joint weights (kit.kernels reads them too). Layers whose linear maps are not
        plain `nn.Linear` (NF4) stay as they are; returns whether all were fused."""
        fused = True
        for layer in self.layers:
            for part, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                                (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
                if all(type(getattr(part, n)) is nn.Linear for n in names):
                    part.fuse()
                else:
                    fused = False
        return fused

    def forward(self, x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
                head: bool = True) -> torch.Tensor:
        """x: token ids [T] (first stage) or hidden [1, T, D]; pos: rope positions [T]; slots: cache
        slots written [T]; mask: [T, S] bool, True where a query may attend a slot.
        Returns hidden [1, T, D], or logits [1, T, V] (fp32) on the last stage unless `head` is False
        (prefill needs no logits). Does not move `length`."""
        h = self.embed_tokens(x)[None] if self.first else x
        dev = None
        for i, layer in enumerate(self.layers):
            w_dev = layer.input_layernorm.weight.device
            if w_dev != dev:
                dev = w_dev
                h, pos_d, slots_d, mask_d = h.to(dev), pos.to(dev), slots.to(dev), mask.to(dev)
                cos, sin = (t[pos_d] for t in self.rope[dev])
            h = layer(h, cos, sin, mask_d, slots_d, self.k_caches[i], self.v_caches[i])
        if self.last and head:
            h = self.lm_head(self.norm(h)).float()
        return h

    def step(self, x: torch.Tensor, tree_parents: list[int] | None = None, head: bool = True) -> torch.Tensor:
        """Append T tokens after `length` as a chain (or a token tree) and advance `length` by T."""
        T = x.shape[0] if self.first else x.shape[1]
        if self.length + T > self.max_len:
            raise ValueError(f"KV cache full: {self.length} + {T} tokens > {self.max_len} slots")
        dev = self.device
        if tree_parents is None:
            pos = torch.arange(self.length, self.length + T, device=dev)
            mask = chain_mask(self.length, T, self.length + T, dev)
        else:
            depth = tree_depths(tree_parents)
            pos = torch.tensor([self.length + d for d in depth], device=dev)
            mask = tree_mask(self.length, tree_parents, self.length + T, dev)
        slots = torch.arange(self.length, self.length + T, device=dev)
        out = self(x, pos, slots, mask, head)
        self.length += T
        return out


def chain_mask(start: int, T: int, S: int, device=None) -> torch.Tensor:
    """[T, S] bool: query i sees slots < start + i + 1."""
    q = torch.arange(T, device=device)[:, None] + start
    return torch.arange(S, device=device)[None, :] <= q


def tree_depths(parents: list[int]) -> list[int]:
    depth = []
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError("tree nodes must come after their parent")
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def tree_mask(start: int, parents: list[int], S: int, device=None) -> torch.Tensor:
    """[T, S] bool for a token tree written at slots start..start+T-1; parents[i] is the index of node
    i's parent among the new tokens (-1: child of the committed prefix). Node i sees the prefix, its
    ancestors and itself."""
    T = len(parents)
    m = torch.zeros(T, S, dtype=torch.bool)
    m[:, :start] = True
    for i, p in enumerate(parents):
        if p >= 0:
            m[i] = m[p]
        m[i, start + i] = True
    return m.to(device)
