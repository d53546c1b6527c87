"""NF4 linear layers that multiply a round's few tokens in one Triton kernel reading the 4-bit weights.

Why we own this (DESIGN decision 1, the hot path): for more than one token bitsandbytes dequantises the
whole weight to fp16 and then multiplies, so a 9-token verify pass moves ~4.5 bytes a parameter (0.5
read, 2 written, 2 read again) instead of the ~0.53 its NF4 weights and scales hold: on the H200 a 14B
stage took 13.7 ms against a 0.84 ms floor (bench/NOTES.md). Here each program reads a block of packed
rows once, turns nibbles into values through the NF4 code and the block scales (bitsandbytes' nested
8-bit scales included) in registers, and multiplies them with all T tokens at once. A prompt (more than
MAX_T tokens) still goes through bitsandbytes, which is right for a matrix that large.

The layout is bitsandbytes': the weight [N, K] flattened row-major, two values a byte (the first in the high
nibble), one scale per 64 consecutive values. Values are rounded to the activation dtype before the
multiply, as bitsandbytes' dequantised weight is, and accumulated in fp32.
Tests run this kernel on CPU with TRITON_INTERPRET=1 (tests/test_nf4.py).
"""
from __future__ import annotations

import os
import sys

import torch
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: bitsandbytes multiplies
    triton = None

MAX_T = 16  # tokens a call may hold to take the kernel: a round's K + 1, and plain decoding's 1
_failed = False  # the kernel failed to compile here once: every layer keeps bitsandbytes


if triton is not None:
    @triton.jit
    def _nf4_kernel(x_ptr, w_ptr, absmax_ptr, code_ptr, code2_ptr, absmax2_ptr, offset_ptr, b_ptr, y_ptr, T, N, K,
                    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr,
                    NESTED: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
        # program: BLOCK_N output features (weight rows) for all T tokens; x [T, K], y [T, N]. A step of the
        # loop reads SUB scale blocks of 64 values a row, each multiplied as a [64, BLOCK_N] tile
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        t = tl.arange(0, BLOCK_T)
        n_ok, t_ok = n < N, t < T
        jj = tl.arange(0, 32)
        if NESTED:
            offset = tl.load(offset_ptr)
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, 64 * SUB):
            for s in tl.static_range(SUB):
                blk = n * (K // 64) + (k0 // 64 + s)
                if NESTED:  # 8-bit codes of the scales, one fp32 scale per 256 of them, plus an offset
                    a = tl.load(absmax_ptr + blk, mask=n_ok, other=0).to(tl.int32)
                    scale = tl.load(code2_ptr + a) * tl.load(absmax2_ptr + blk // 256, mask=n_ok, other=0.0) + offset
                else:
                    scale = tl.load(absmax_ptr + blk, mask=n_ok, other=0.0)
                # [BLOCK_N, 32] bytes, each row's contiguous; high nibbles meet the even inputs, low ones the odd
                packed = tl.load(w_ptr + n[:, None] * (K // 2) + (k0 // 2 + s * 32) + jj[None, :],
                                 mask=n_ok[:, None], other=0)
                k = k0 + s * 64 + 2 * jj
                x_even = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=t_ok[:, None], other=0.0)
                x_odd = tl.load(x_ptr + t[:, None] * K + k[None, :] + 1, mask=t_ok[:, None], other=0.0)
                w_hi = (tl.load(code_ptr + (packed >> 4)) * scale[:, None]).to(x_even.dtype)
                w_lo = (tl.load(code_ptr + (packed & 15)) * scale[:, None]).to(x_even.dtype)
                if IEEE:
                    acc += tl.dot(x_even, tl.trans(w_hi), input_precision="ieee")
                    acc += tl.dot(x_odd, tl.trans(w_lo), input_precision="ieee")
                else:
                    acc += tl.dot(x_even, tl.trans(w_hi))
                    acc += tl.dot(x_odd, tl.trans(w_lo))
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + t[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=t_ok[:, None] & n_ok[None, :])


def tiles(n: int, k: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_N, SUB, warps, stages) for an [n, k] weight: SUB scale blocks a loop step (as many as divide k, up
    to 4), and rows few enough that every multiprocessor gets about two programs (these layers are read once;
    idle SMs are lost bandwidth)."""
    sub = next(b for b in (4, 2, 1) if k % (64 * b) == 0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    block_n = 16
    while block_n < 128 and triton.cdiv(n, block_n * 2) >= 2 * sms:
        block_n *= 2
    return block_n, sub, 4, 2


def matmul(x: torch.Tensor, q: nn.Module, tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [..., K] (at most MAX_T rows) times the NF4 layer q's weight, plus its bias: [..., N] in x's dtype.
    `tile`: (BLOCK_N, SUB, warps, stages) instead of `tiles`' choice (bench/nf4.py tries them)."""
    state = q.weight.quant_state
    K, N = q.in_features, q.out_features
    x2 = x.reshape(-1, K).contiguous()
    T = x2.shape[0]
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    nested = bool(state.nested)
    s2 = state.state2 if nested else None
    block_n, sub, warps, stages = tile or tiles(N, K, x.device)
    _nf4_kernel[(triton.cdiv(N, block_n),)](
        x2, q.weight.data, state.absmax, state.code, s2.code if nested else state.code,
        s2.absmax if nested else state.absmax, state.offset if nested else state.absmax,
        q.bias if q.bias is not None else y, y, T, N, K,
        BLOCK_T=max(16, triton.next_power_of_2(T)), BLOCK_N=block_n, SUB=sub, NESTED=nested,
        HAS_BIAS=q.bias is not None, IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages)
    return y.view(*x.shape[:-1], N)


def supported(q: nn.Module, x: torch.Tensor) -> bool:
    """Whether the kernel can multiply by bitsandbytes layer q: NF4 in 64-value blocks (nested scales in blocks of
    256, as bitsandbytes makes them), K a multiple of 64, fp16 or fp32 activations, on a GPU Triton compiles for
    (or in the interpreter)."""
    state = getattr(q.weight, "quant_state", None)
    if triton is None or state is None or state.quant_type != "nf4" or state.blocksize != 64:
        return False
    if state.nested and state.state2.blocksize != 256:
        return False
    if x.device.type == "cuda":
        on_device = torch.cuda.get_device_capability(x.device) >= (7, 0)
    else:
        on_device = os.environ.get("TRITON_INTERPRET") == "1"
    return on_device and q.in_features % 64 == 0 and x.dtype in (torch.float16, torch.float32)


class NF4Linear(nn.Module):
    """A bitsandbytes NF4 layer whose few-token products (a round, a decode step) take `matmul`; a prompt's
    go through bitsandbytes. A GPU or Triton version the kernel fails to compile on keeps bitsandbytes."""

    def __init__(self, q: nn.Module):
        super().__init__()
        self.q = q
        self.fast: bool | None = None  # decided on the first call, on the layer's device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global _failed
        if self.fast is None:
            self.fast = supported(self.q, x)
        if _failed or not self.fast or x.numel() // x.shape[-1] > MAX_T:
            return self.q(x)
        try:
            return matmul(x, self.q)
        except Exception as e:  # Triton compiles on first use (warm-up, before any graph capture)
            print(f"[nf4] Triton kernel failed ({type(e).__name__}: {str(e)[:200]}); multiplying with "
                  "bitsandbytes", file=sys.stderr)
            _failed = True
            return self.q(x)
