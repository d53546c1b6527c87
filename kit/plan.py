"""Stage planning: which layers each node holds, which of its GPUs holds each layer, and whether it fits.

Everything is estimated from the config alone, so a plan can be checked before anything downloads.
Per GPU in use the estimate is: weights + KV cache (+ the drafter's weights and KV cache) + overhead,
where the overhead is

- `CUDA_CONTEXT_BYTES` (0.4 GiB): driver and lazily loaded kernels, outside PyTorch's allocator.
  About 300-400 MB with CUDA >= 11.7 (pytorch/pytorch#109888); 621 MiB was seen on an H200 with CUDA 13.
- `WORK_BYTES` (0.45 GiB): activations of a forward of up to 128 new tokens besides the attention term
  below, cuBLAS workspace, and some room for allocator fragmentation. Measured on an H200 (fp16, math
  attention as on a T4, 14B shapes): a half stage prefilled in 128-token chunks to 4000 tokens, then
  verified 9 tokens at a time, peaked at 14.63 GiB allocated; this estimate, context left out, says
  14.77. Prefill chunks of 256 tokens peaked 0.16 GiB higher. The caching allocator kept up to 4.5 GiB
  more reserved than allocated there (freed attention temporaries of every cache length stay cached);
  under memory pressure it frees them and retries, which costs a sync: run nodes with
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
- `attention_bytes`: with a mask and grouped-query attention, SDPA's flash and memory-efficient kernels
  refuse (torch 2.11, checked on an H200) and cuDNN's needs sm80, so a T4 (sm75) takes the math path,
  which holds K and V of the whole cache for every query head in fp32. It grows with the KV length.
- the rope tables of `Stage.setup_cache` (fp32 cos and sin over max(kv_len, max_position_embeddings)).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kit.model import ModelConfig

GiB = 2**30
# A Kaggle/Colab T4 as CUDA reports it (torch total_memory 15079-15110 MiB depending on the driver);
# nvidia-smi's 15360 MiB includes memory the driver keeps for itself.
T4_BYTES = 15095 * 2**20
CUDA_CONTEXT_BYTES = int(0.4 * GiB)
WORK_BYTES = int(0.45 * GiB)
# bitsandbytes NF4 (blocksize 64, double quant): 4-bit codes, a uint8 absmax per 64 weights, an fp32
# absmax per 256 of those: 4 + 8/64 + 32/16384 = 4.127 bits per weight.
NF4_BLOCK, NF4_BLOCK2 = 64, 256


class PlanError(ValueError):
    """A plan that cannot fit, or cannot be made."""


@dataclass
class DeviceMemory:
    weights: int = 0
    kv: int = 0
    draft: int = 0  # drafter weights, KV cache, rope tables, attention expansion
    overhead: int = 0  # context, activations, attention expansion, rope tables

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.draft + self.overhead


@dataclass
class StagePlan:
    index: int
    start: int  # global layer range [start, end)
    end: int
    first: bool
    last: bool
    device_layers: list[tuple[str, int, int]]  # (device, start, end) in global layer indices
    memory: dict[str, DeviceMemory]  # per device in use
    gpu_bytes: float  # capacity of each GPU of this node
    draft_device: str | None = None

    @property
    def devices(self) -> list[str]:
        return list(self.memory)

    @property
    def total(self) -> int:
        return sum(m.total for m in self.memory.values())

    @property
    def weights(self) -> int:
        return sum(m.weights for m in self.memory.values())

    @property
    def kv(self) -> int:
        return sum(m.kv for m in self.memory.values())


def layer_params(cfg: ModelConfig) -> tuple[int, int]:
    """(weights of the linear layers, everything else: biases and norms) in one decoder layer."""
    d, q, kv, i = cfg.hidden_size, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate_size
    linear = d * q + 2 * d * kv + q * d + 3 * d * i
    other = 2 * d + (q + 2 * kv if cfg.qkv_bias else 0) + (2 * cfg.head_dim if cfg.qk_norm else 0)
    return linear, other


def linear_shapes(cfg: ModelConfig) -> list[int]:
    d, q, kv, i = cfg.hidden_size, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate_size
    return [d * q, d * kv, d * kv, q * d, d * i, d * i, i * d]


def nf4_bytes(n: int) -> int:
    blocks = math.ceil(n / NF4_BLOCK)
    return (n + 1) // 2 + blocks + 4 * math.ceil(blocks / NF4_BLOCK2)


def estimate_weights(cfg: ModelConfig, start: int, end: int, first: bool, last: bool,
                     dtype_bytes: float = 2, load_in_4bit: bool = False) -> int:
    """Bytes of a stage's parameters, from the config's shapes.

    Embedding on the first stage, norm + LM head on the last. `Stage` always has its own `lm_head`
    (kit.load copies a tied embedding into it), so a tied head costs a copy even on a one-stage model.
    With `load_in_4bit` only the decoder's linear weights are NF4; biases, norms, embedding and head
    stay 16-bit.
    """
    linear, other = layer_params(cfg)
    per_layer = (sum(nf4_bytes(n) for n in linear_shapes(cfg)) if load_in_4bit else linear * dtype_bytes)
    total = (end - start) * (per_layer + other * dtype_bytes)
    table = cfg.vocab_size * cfg.hidden_size
    if first:
        total += table * dtype_bytes
    if last:
        total += (table + cfg.hidden_size) * dtype_bytes
    return int(total)


def estimate_kv(cfg: ModelConfig, n_layers: int, kv_len: int, dtype_bytes: float = 2) -> int:
    """K and V for `kv_len` tokens: 2 x layers x kv_heads x head_dim x kv_len x bytes."""
    return int(2 * n_layers * cfg.n_kv_heads * cfg.head_dim * kv_len * dtype_bytes)


def attention_bytes(cfg: ModelConfig, kv_len: int) -> int:
    """Transient K and V expanded to every query head in fp32 (math attention, see module doc)."""
    return 2 * cfg.n_heads * kv_len * cfg.head_dim * 4


def rope_bytes(cfg: ModelConfig, kv_len: int) -> int:
    return 2 * max(kv_len, cfg.max_position_embeddings) * cfg.head_dim * 4


def spread(n: int, fixed: list[float], unit: float, capacity: list[float]) -> list[int]:
    """Counts of `n` equal items (>= 1 each) over bins with fixed costs, keeping the fullest bin as
    empty as possible: each item goes where it leaves the lowest fill fraction."""
    counts = [1] * len(fixed)
    for _ in range(n - len(fixed)):
        j = min(range(len(fixed)), key=lambda j: ((fixed[j] + (counts[j] + 1) * unit) / capacity[j], j))
        counts[j] += 1
    return counts


def even_split(n: int, s: int) -> list[int]:
    """n // s layers each; the remainder goes to middle stages first, then the last, then the first
    (the ends also hold the embedding, head and drafter)."""
    sizes = [n // s] * s
    order = list(range(1, s - 1)) + [s - 1, 0] if s > 1 else [0]
    for i in order[: n % s]:
        sizes[i] += 1
    return sizes


def place_node(cfg: ModelConfig, index: int, start: int, end: int, first: bool, last: bool, *,
               gpus: int, gpu_bytes: float, dtype_bytes: float, load_in_4bit: bool, kv_len: int,
               draft: tuple[int, int] | None) -> StagePlan:
    """Spread one stage's layers over its node's GPUs (contiguous, bytes balanced) and put the drafter
    (weights, KV) where the fullest GPU ends up emptiest."""
    n = end - start
    g = min(gpus, n)
    layer = estimate_weights(cfg, 0, 1, False, False, dtype_bytes, load_in_4bit)
    layer_kv = estimate_kv(cfg, 1, kv_len, dtype_bytes)
    embed = estimate_weights(cfg, 0, 0, True, False, dtype_bytes) if first else 0
    head = estimate_weights(cfg, 0, 0, False, True, dtype_bytes) if last else 0
    best = None
    for d in range(g) if draft else [None]:
        fixed = [0.0] * g
        fixed[0] += embed
        fixed[-1] += head
        if d is not None:
            fixed[d] += sum(draft)
        counts = spread(n, fixed, layer + layer_kv, [gpu_bytes] * g)
        peak = max(f + c * (layer + layer_kv) for f, c in zip(fixed, counts))
        if best is None or peak < best[0]:
            best = (peak, d, counts)
    _, d, counts = best
    overhead = CUDA_CONTEXT_BYTES + WORK_BYTES + attention_bytes(cfg, kv_len) + rope_bytes(cfg, kv_len)
    device_layers, memory, a = [], {}, start
    for j, c in enumerate(counts):
        dev = f"cuda:{j}"
        device_layers.append((dev, a, a + c))
        memory[dev] = DeviceMemory(weights=c * layer + (embed if j == 0 else 0) + (head if j == g - 1 else 0),
                                   kv=c * layer_kv, draft=sum(draft) if j == d else 0, overhead=overhead)
        a += c
    return StagePlan(index, start, end, first, last, device_layers, memory, gpu_bytes,
                     draft_device=None if d is None else f"cuda:{d}")


def plan_stages(cfg: ModelConfig, n_stages: int, *, dtype_bytes: float = 2, load_in_4bit: bool = False,
                kv_len: int = 4096, gpus_per_node: int = 1, gpu_bytes: float | None = None,
                budgets: list[float] | None = None, draft_cfg: ModelConfig | None = None,
                draft_kv_len: int | None = None) -> list[StagePlan]:
    """Split the model's layers over `n_stages` nodes of `gpus_per_node` GPUs each, and check it fits.

    Without `budgets` the layers are split evenly and every GPU holds `gpu_bytes` (default a T4).
    `budgets` (bytes per node, shared equally by its GPUs; they replace `gpu_bytes`) split the layers so that the fullest node
    is as empty as possible, after the first node pays for the embedding and the drafter and the last
    for the norm and head. The drafter (16-bit, never NF4) lives on node 0. Raises PlanError when a
    GPU would overflow, saying by how much and what to change.
    """
    n = cfg.n_layers
    if not 1 <= n_stages <= n:
        raise PlanError(f"cannot split {n} layers into {n_stages} stages: use 1 to {n} stages")
    if gpus_per_node < 1:
        raise PlanError(f"a node needs at least one GPU, got {gpus_per_node}")
    if budgets is not None and len(budgets) != n_stages:
        raise PlanError(f"{len(budgets)} budgets for {n_stages} stages: give one per node")
    per_gpu = ([b / gpus_per_node for b in budgets] if budgets is not None
               else [gpu_bytes or T4_BYTES] * n_stages)
    draft = None
    if draft_cfg is not None:
        dl = draft_kv_len or kv_len
        draft = (estimate_weights(draft_cfg, 0, draft_cfg.n_layers, True, True, dtype_bytes),
                 estimate_kv(draft_cfg, draft_cfg.n_layers, dl, dtype_bytes)
                 + rope_bytes(draft_cfg, dl) + attention_bytes(draft_cfg, dl))
    if budgets is None:
        sizes = even_split(n, n_stages)
    else:
        unit = estimate_weights(cfg, 0, 1, False, False, dtype_bytes, load_in_4bit) + estimate_kv(cfg, 1, kv_len, dtype_bytes)
        overhead = gpus_per_node * (CUDA_CONTEXT_BYTES + WORK_BYTES + attention_bytes(cfg, kv_len) + rope_bytes(cfg, kv_len))
        fixed = [overhead + estimate_weights(cfg, 0, 0, i == 0, i == n_stages - 1, dtype_bytes)
                 + (sum(draft) if draft and i == 0 else 0) for i in range(n_stages)]
        sizes = spread(n, fixed, unit, list(budgets))
    plans, a = [], 0
    for i, size in enumerate(sizes):
        plans.append(place_node(cfg, i, a, a + size, i == 0, i == n_stages - 1, gpus=gpus_per_node,
                                gpu_bytes=per_gpu[i], dtype_bytes=dtype_bytes, load_in_4bit=load_in_4bit,
                                kv_len=kv_len, draft=draft if i == 0 else None))
        a += size
    check_fit(plans, cfg, kv_len, load_in_4bit, gpus_per_node)
    return plans


def check_fit(plans: list[StagePlan], cfg: ModelConfig, kv_len: int, load_in_4bit: bool, gpus: int) -> None:
    over = [(p, dev, m) for p in plans for dev, m in p.memory.items() if m.total > p.gpu_bytes]
    if not over:
        return
    p, dev, m = max(over, key=lambda o: o[2].total - o[0].gpu_bytes)
    need = sum(q.total for q in plans) / (plans[0].gpu_bytes * gpus)
    fixes = [f"more stages (about {math.ceil(need)} nodes of {gpus} GPU(s) hold it all)"]
    if gpus == 1:
        fixes.append("both GPUs of each node (--device cuda:0,cuda:1)")
    if not load_in_4bit:
        fixes.append("--load-in-4bit")
    fixes.append(f"a shorter KV cache (each 1024 tokens cost {gib(estimate_kv(cfg, cfg.n_layers, 1024))} GiB "
                 f"over the whole model)")
    raise PlanError(
        f"stage {p.index} (layers {p.start}-{p.end - 1}) does not fit: {dev} needs {gib(m.total)} GiB "
        f"(weights {gib(m.weights)}, KV {gib(m.kv)}, drafter {gib(m.draft)}, overhead {gib(m.overhead)}) "
        f"but holds {gib(p.gpu_bytes)} GiB, {gib(m.total - p.gpu_bytes)} GiB short "
        f"({len(over)} GPU(s) over in all). Use " + ", or ".join(fixes) + "."
    )


def gib(b: float) -> str:
    return f"{b / GiB:.2f}"


def layer_devices(plan: StagePlan) -> list[str]:
    """The device of each of the stage's layers, in local order (what `kit.load.load_stage` takes)."""
    return [dev for dev, a, b in plan.device_layers for _ in range(a, b)]


def format_plan(plans: list[StagePlan]) -> str:
    """A table: one row per GPU of each stage, GiB per column."""
    rows = [("stage", "layers", "device", "its layers", "weights", "KV", "drafter", "overhead", "total", "of")]
    for p in plans:
        for dev, a, b in p.device_layers:
            m = p.memory[dev]
            rows.append((str(p.index), f"{p.start}-{p.end - 1}", dev, f"{a}-{b - 1}", gib(m.weights), gib(m.kv),
                         gib(m.draft), gib(m.overhead), gib(m.total), gib(p.gpu_bytes)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if k >= 4 else c.ljust(w) for k, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in rows]
    return "\n".join(lines + ["(GiB; overhead = CUDA context, activations, attention expansion, rope tables)"])
