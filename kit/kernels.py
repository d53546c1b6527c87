"""Triton kernels for one token through a whole small model: the drafter's step in five kernels a layer.

Why we own this (DESIGN decision 1, the hot path): a Qwen2.5-0.5B step reads 1 GB, 0.23 ms at an H200's
4.2 TB/s, but written as PyTorch ops a layer is ~12 kernels even after torch.compile has fused what it
can, and at one token each kernel is mostly launch and tail: 8.0 ms for an 8-token draft, 4.3x the
floor. Here a layer is five kernels (4.4 ms for those 8 tokens on an H200, with dependent launch;
bench/NOTES.md, v5, v6 and v9):

  1. qkv     RMSNorm of x, the joined q/k/v rows, bias, q/k norm (Qwen3), rope; K and V go to the cache
  2. attend  a block of cache slots per program: scores, masked softmax statistics, P.V
  3. o       the blocks combined, the o projection, the residual added in place
  4. gate_up RMSNorm of x, gate and up rows, silu(gate) * up
  5. down    the down projection, the residual added in place

and the head is RMSNorm + logits (kept on request, for overlap's runner-up branches) + an argmax per block
of rows; one small kernel then picks the best block's token and copies its embedding row in as the next
step's x, so a whole draft runs without a PyTorch op between steps. Every program of a projection reads the
whole input vector (a few KB, from L2) and normalises it itself, so norms need no kernel of their own.
Rounding follows the PyTorch path (fp16 after each projection, norm and activation; fp32 inside), so
drafts match the eager drafter's up to near-ties. On compute capability 9.0+ every kernel is launched with
programmatic dependent launch and loads its weights while the previous kernel finishes (`_after_previous`).
Tests run these kernels on CPU with TRITON_INTERPRET=1.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the drafter runs eagerly there
    triton = None

from kit.model import Stage


def available(stage: Stage) -> bool:
    """Whether `stage` can run its one-token step with these kernels: a GPU Triton compiles for (or the
    interpreter), fp16 or fp32, plain joined projections on one device, head sizes the kernels tile.
    Triton is tested on compute capability 8.0 and up; on a T4 (7.5) a kernel that fails to compile sends
    the drafter back to PyTorch ops (ModelDrafter); Kaggle's P100 (6.0) is below what Triton runs on."""
    cfg = stage.cfg
    if stage.device.type == "cuda":
        on_device = torch.cuda.get_device_capability(stage.device) >= (7, 0)
    else:
        on_device = os.environ.get("TRITON_INTERPRET") == "1"
    devices = {layer.input_layernorm.weight.device for layer in stage.layers}
    return (triton is not None and on_device and len(devices) == 1 and stage.first and stage.last
            and stage.dtype in (torch.float16, torch.float32)  # bf16: untested (the interpreter mangles it)
            and cfg.head_dim in (16, 32, 64, 128, 256) and cfg.n_heads // cfg.n_kv_heads <= ROWS
            and stage.fuse())


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


if triton is not None:
    @triton.jit
    def _after_previous(PDL: tl.constexpr):
        """With programmatic dependent launch (Hopper and newer), a kernel starts while the one before it
        finishes; each kernel first lets the next one start, loads its weights (no kernel writes them),
        then waits here before it touches what the previous kernel wrote or reads."""
        if PDL:
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def _let_next_start(PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _rstd(x_ptr, D: tl.constexpr, BLOCK_K: tl.constexpr, eps):
        """1 / RMS of the vector x [D], in fp32."""
        acc = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + k, mask=k < D, other=0.0).to(tl.float32)
            acc += x * x
        return tl.rsqrt(tl.sum(acc, 0) / D + eps)

    @triton.jit
    def _normed(x_ptr, nw_ptr, k, D: tl.constexpr, rstd):
        """RMSNorm(x)[k] as the PyTorch module rounds it: weight * (x * rstd).to(dtype), returned in fp32."""
        x = tl.load(x_ptr + k, mask=k < D, other=0.0)
        w = tl.load(nw_ptr + k, mask=k < D, other=0.0)
        return (w * (x.to(tl.float32) * rstd).to(x.dtype)).to(tl.float32)

    @triton.jit
    def _two_projections(x_ptr, nw_ptr, w_ptr, rows_a, rows_b, row_ok, eps, D: tl.constexpr,
                         BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """Rows rows_a and rows_b of w [*, D] times RMSNorm(x), in fp32; the weights' first chunk is
        loaded before waiting on the previous kernel."""
        k = tl.arange(0, BLOCK_K)
        m = row_ok[:, None] & (k < D)[None, :]
        w_a = tl.load(w_ptr + rows_a[:, None] * D + k[None, :], mask=m, other=0.0)
        w_b = tl.load(w_ptr + rows_b[:, None] * D + k[None, :], mask=m, other=0.0)
        _after_previous(PDL)
        rstd = _rstd(x_ptr, D, BLOCK_K, eps)
        h = _normed(x_ptr, nw_ptr, k, D, rstd)[None, :]
        acc_a = w_a.to(tl.float32) * h
        acc_b = w_b.to(tl.float32) * h
        for k0 in range(BLOCK_K, D, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            h = _normed(x_ptr, nw_ptr, k, D, rstd)[None, :]
            m = row_ok[:, None] & (k < D)[None, :]
            acc_a += tl.load(w_ptr + rows_a[:, None] * D + k[None, :], mask=m, other=0.0).to(tl.float32) * h
            acc_b += tl.load(w_ptr + rows_b[:, None] * D + k[None, :], mask=m, other=0.0).to(tl.float32) * h
        return tl.sum(acc_a, 1), tl.sum(acc_b, 1)

    @triton.jit(do_not_specialize=["pos_add"])
    def _qkv_kernel(x_ptr, nw_ptr, w_ptr, b_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, pos_add, q_ptr, kc_ptr,
                    vc_ptr, max_len, eps, qk_eps, D: tl.constexpr, E: tl.constexpr, H: tl.constexpr,
                    G: tl.constexpr, P: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                    QK_NORM: tl.constexpr, PDL: tl.constexpr):
        # program: one of the H + 2G q/k/v heads, P of its rotation pairs (i, i + E/2)
        _let_next_start(PDL)
        HALF: tl.constexpr = E // 2
        per_head: tl.constexpr = HALF // P
        head = tl.program_id(0) // per_head
        i = (tl.program_id(0) % per_head) * P + tl.arange(0, P)
        rows_lo, rows_hi = head * E + i, head * E + HALF + i
        lo, hi = _two_projections(x_ptr, nw_ptr, w_ptr, rows_lo, rows_hi, i < HALF, eps, D, BLOCK_K, PDL)
        if HAS_BIAS:
            lo += tl.load(b_ptr + rows_lo).to(tl.float32)
            hi += tl.load(b_ptr + rows_hi).to(tl.float32)
        dt = x_ptr.dtype.element_ty
        lo, hi = lo.to(dt).to(tl.float32), hi.to(dt).to(tl.float32)
        pos = tl.load(pos_ptr) + pos_add
        if head < H + G:  # q or k: norm (Qwen3) and rope
            if QK_NORM:  # P == E / 2 here: the program holds the whole head
                r = tl.rsqrt((tl.sum(lo * lo, 0) + tl.sum(hi * hi, 0)) / E + qk_eps)
                is_q = head < H
                n_lo = tl.where(is_q, tl.load(qn_ptr + i), tl.load(kn_ptr + i))
                n_hi = tl.where(is_q, tl.load(qn_ptr + HALF + i), tl.load(kn_ptr + HALF + i))
                lo = (n_lo * (lo * r).to(dt)).to(tl.float32)
                hi = (n_hi * (hi * r).to(dt)).to(tl.float32)
            c_lo, c_hi = tl.load(cos_ptr + pos * E + i), tl.load(cos_ptr + pos * E + HALF + i)
            s_lo, s_hi = tl.load(sin_ptr + pos * E + i), tl.load(sin_ptr + pos * E + HALF + i)
            lo, hi = lo * c_lo - hi * s_lo, hi * c_hi + lo * s_hi
        if head < H:
            tl.store(q_ptr + rows_lo, lo.to(dt))
            tl.store(q_ptr + rows_hi, hi.to(dt))
        elif head < H + G:
            at = kc_ptr + (head - H) * max_len * E + pos * E
            tl.store(at + i, lo.to(dt))
            tl.store(at + HALF + i, hi.to(dt))
        else:
            at = vc_ptr + (head - H - G) * max_len * E + pos * E
            tl.store(at + i, lo.to(dt))
            tl.store(at + HALF + i, hi.to(dt))

    @triton.jit(do_not_specialize=["pos_add"])
    def _attend_kernel(q_ptr, kc_ptr, vc_ptr, pos_ptr, pos_add, acc_ptr, m_ptr, l_ptr, max_len, span, scale,
                       E: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, PER: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
        # program: kv head g, slots [s * PER, (s + 1) * PER); its R query heads are the rows of one matrix
        _let_next_start(PDL)
        _after_previous(PDL)
        g, s = tl.program_id(0), tl.program_id(1)
        n_split = tl.num_programs(1)
        rows, e = tl.arange(0, RP), tl.arange(0, E)
        q = tl.load(q_ptr + (g * R + rows)[:, None] * E + e[None, :], mask=(rows < R)[:, None], other=0.0)
        pos = tl.load(pos_ptr) + pos_add
        m = tl.full([RP], float("-inf"), dtype=tl.float32)
        l = tl.zeros([RP], dtype=tl.float32)
        acc = tl.zeros([RP, E], dtype=tl.float32)
        base = g * max_len * E
        for off in range(0, PER, BLOCK):
            j = s * PER + off + tl.arange(0, BLOCK)
            ok = (j <= pos) & (j < span)
            k = tl.load(kc_ptr + base + j[:, None] * E + e[None, :], mask=ok[:, None], other=0.0)
            v = tl.load(vc_ptr + base + j[:, None] * E + e[None, :], mask=ok[:, None], other=0.0)
            scores = tl.where(ok[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(scores - safe[:, None])
            alpha = tl.exp(m - safe)
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        at = (g * n_split + s) * RP + rows
        tl.store(m_ptr + at, m)
        tl.store(l_ptr + at, l)
        tl.store(acc_ptr + at[:, None] * E + e[None, :], acc)

    @triton.jit
    def _o_kernel(acc_ptr, m_ptr, l_ptr, w_ptr, x_ptr, n_split, D: tl.constexpr, E: tl.constexpr,
                  R: tl.constexpr, RP: tl.constexpr, HE: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        # program: output rows n of x += o_proj(attention), combining the attention blocks as it reads them
        _let_next_start(PDL)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        w_first = tl.load(w_ptr + n[:, None] * HE + k[None, :], mask=(n < D)[:, None] & (k < HE)[None, :], other=0.0)
        _after_previous(PDL)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, HE, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < HE
            head = k // E
            g, r, e = head // R, head % R, k % E
            big_m = tl.full([BLOCK_K], float("-inf"), dtype=tl.float32)
            big_l = tl.zeros([BLOCK_K], dtype=tl.float32)
            y = tl.zeros([BLOCK_K], dtype=tl.float32)
            for s in range(0, n_split):
                at = (g * n_split + s) * RP + r
                m = tl.load(m_ptr + at, mask=km, other=float("-inf"))
                m_new = tl.maximum(big_m, m)
                safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                c_old, c_new = tl.exp(big_m - safe), tl.exp(m - safe)
                big_l = big_l * c_old + tl.load(l_ptr + at, mask=km, other=0.0) * c_new
                y = y * c_old + tl.load(acc_ptr + at * E + e, mask=km, other=0.0) * c_new
                big_m = m_new
            y = tl.where(km, y / tl.where(km, big_l, 1.0), 0.0)
            if k0 == 0:
                w = w_first
            else:
                w = tl.load(w_ptr + n[:, None] * HE + k[None, :], mask=(n < D)[:, None] & km[None, :], other=0.0)
            acc += w.to(tl.float32) * y.to(w.dtype).to(tl.float32)[None, :]
        x = tl.load(x_ptr + n, mask=n < D)
        tl.store(x_ptr + n, x + tl.sum(acc, 1).to(x.dtype), mask=n < D)

    @triton.jit
    def _gate_up_kernel(x_ptr, nw_ptr, w_ptr, out_ptr, eps, D: tl.constexpr, F: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        # program: rows n of silu(gate(norm(x))) * up(norm(x)); gate rows are 0..F-1 of w, up rows F..2F-1
        _let_next_start(PDL)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        gate, up = _two_projections(x_ptr, nw_ptr, w_ptr, n, F + n, n < F, eps, D, BLOCK_K, PDL)
        dt = x_ptr.dtype.element_ty
        gate = gate.to(dt).to(tl.float32)
        up = up.to(dt)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt)
        tl.store(out_ptr + n, act * up, mask=n < F)

    @triton.jit
    def _down_kernel(h_ptr, w_ptr, x_ptr, D: tl.constexpr, F: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        # program: rows n of x += down(h)
        _let_next_start(PDL)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + n[:, None] * F + k[None, :], mask=(n < D)[:, None] & (k < F)[None, :], other=0.0)
        _after_previous(PDL)
        h = tl.load(h_ptr + k, mask=k < F, other=0.0).to(tl.float32)
        acc = w.to(tl.float32) * h[None, :]
        for k0 in range(BLOCK_K, F, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            h = tl.load(h_ptr + k, mask=k < F, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + n[:, None] * F + k[None, :], mask=(n < D)[:, None] & (k < F)[None, :], other=0.0)
            acc += w.to(tl.float32) * h[None, :]
        x = tl.load(x_ptr + n, mask=n < D)
        tl.store(x_ptr + n, x + tl.sum(acc, 1).to(x.dtype), mask=n < D)

    @triton.jit
    def _head_kernel(x_ptr, nw_ptr, w_ptr, best_ptr, at_ptr, logits_ptr, vocab, eps, D: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KEEP: tl.constexpr, PDL: tl.constexpr):
        # program: logits of rows n (rounded to the weights' dtype as F.linear does), their max and its index;
        # with KEEP the logits themselves too
        _let_next_start(PDL)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + n[:, None] * D + k[None, :], mask=(n < vocab)[:, None] & (k < D)[None, :], other=0.0)
        _after_previous(PDL)
        rstd = _rstd(x_ptr, D, BLOCK_K, eps)
        acc = w.to(tl.float32) * _normed(x_ptr, nw_ptr, k, D, rstd)[None, :]
        for k0 in range(BLOCK_K, D, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            h = _normed(x_ptr, nw_ptr, k, D, rstd)[None, :]
            w = tl.load(w_ptr + n[:, None] * D + k[None, :], mask=(n < vocab)[:, None] & (k < D)[None, :], other=0.0)
            acc += w.to(tl.float32) * h
        logits = tl.where(n < vocab, tl.sum(acc, 1).to(x_ptr.dtype.element_ty).to(tl.float32), float("-inf"))
        if KEEP:
            tl.store(logits_ptr + n, logits, mask=n < vocab)
        best = tl.argmax(logits, 0, tie_break_left=True)
        tl.store(best_ptr + tl.program_id(0), tl.max(logits, 0))
        tl.store(at_ptr + tl.program_id(0), tl.program_id(0) * BLOCK_N + best)

    @triton.jit(do_not_specialize=["j"])
    def _pick_kernel(best_ptr, at_ptr, n_blocks, tok_ptr, j, emb_ptr, x_ptr, D: tl.constexpr, BLOCK: tl.constexpr,
                     BLOCK_D: tl.constexpr, FROM_HEAD: tl.constexpr, PDL: tl.constexpr):
        # one program: with FROM_HEAD the best of the head's blocks (the first on ties, as torch.argmax) is
        # the token, stored at tok[j]; else tok[j] is read. Either way its embedding row becomes x
        _let_next_start(PDL)
        _after_previous(PDL)
        if FROM_HEAD:
            b = tl.arange(0, BLOCK)
            v = tl.load(best_ptr + b, mask=b < n_blocks, other=float("-inf"))
            top, where = tl.max(v, 0), tl.argmax(v, 0, tie_break_left=True)
            for b0 in range(BLOCK, n_blocks, BLOCK):
                v = tl.load(best_ptr + b0 + b, mask=b0 + b < n_blocks, other=float("-inf"))
                m = tl.max(v, 0)
                better = m > top
                where = tl.where(better, b0 + tl.argmax(v, 0, tie_break_left=True), where)
                top = tl.where(better, m, top)
            tok = tl.load(at_ptr + where)
            tl.store(tok_ptr + j, tok)
        else:
            tok = tl.load(tok_ptr + j)
        d = tl.arange(0, BLOCK_D)
        tl.store(x_ptr + d, tl.load(emb_ptr + tok * D + d, mask=d < D), mask=d < D)


ROWS = 16  # query rows per kv head in the attention kernel, padded: tl.dot needs 16
# Tile sizes per kernel, chosen with bench/kernel_tiles.py on an H200 for the Qwen2.5-0.5B shape.
TILES = {"qkv_pairs": 4, "qkv_warps": 4, "attn_slots": 128, "attn_block": 64, "o_rows": 8, "gate_up_rows": 8,
         "gate_up_warps": 4, "down_rows": 2, "down_cols": 4096, "down_warps": 8, "head_rows": 16, "head_warps": 8,
         "pdl": True}


def _pdl(x: torch.Tensor, tiles: dict) -> dict:
    """Launch options for programmatic dependent launch where the GPU has it (compute capability 9.0+)."""
    on = (tiles.get("pdl", False) and x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) >= (9, 0))
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


class Scratch:
    """Buffers of a draft: x (the residual stream), q, the attention blocks' partial results (ROWS query
    rows per kv head and block), the MLP activation, the head's best logit and its id per block of rows."""

    def __init__(self, stage: Stage, span: int, tiles: dict, vocab: int):
        cfg, dev, dt = stage.cfg, stage.device, stage.dtype
        self.n_split = triton.cdiv(span, tiles["attn_slots"])
        self.x = torch.empty(cfg.hidden_size, dtype=dt, device=dev)
        self.q = torch.empty(cfg.n_heads * cfg.head_dim, dtype=dt, device=dev)
        self.m = torch.empty(cfg.n_kv_heads * self.n_split * ROWS, dtype=torch.float32, device=dev)
        self.l = torch.empty_like(self.m)
        self.acc = torch.empty(self.m.numel() * cfg.head_dim, dtype=torch.float32, device=dev)
        self.act = torch.empty(cfg.intermediate_size, dtype=dt, device=dev)
        self.vocab, n_blocks = vocab, triton.cdiv(vocab, tiles["head_rows"])
        self.best = torch.empty(n_blocks, dtype=torch.float32, device=dev)
        self.at = torch.empty(n_blocks, dtype=torch.int64, device=dev)


def qkv(stage: Stage, i: int, x: torch.Tensor, pos: torch.Tensor, s: Scratch, tiles: dict, at: int = 0) -> None:
    """Layer i's q into s.q, its K and V into the cache at slot `pos` + at."""
    cfg, layer = stage.cfg, stage.layers[i]
    attn, norm = layer.self_attn, layer.input_layernorm
    D, E, H, G = cfg.hidden_size, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    P = E // 2 if cfg.qk_norm else min(tiles["qkv_pairs"], E // 2)
    w, b = attn.qkv
    qn, kn = (attn.q_norm.weight, attn.k_norm.weight) if cfg.qk_norm else (w, w)
    cos, sin = stage.rope[stage.device]
    _qkv_kernel[((H + 2 * G) * (E // 2 // P),)](
        x, norm.weight, w, w if b is None else b, qn, kn, cos, sin, pos, at, s.q, stage.k_caches[i], stage.v_caches[i],
        stage.max_len, norm.eps, attn.q_norm.eps if cfg.qk_norm else 0.0, D=D, E=E, H=H, G=G, P=P,
        BLOCK_K=min(1024, _pow2(D)), HAS_BIAS=b is not None, QK_NORM=cfg.qk_norm, num_warps=tiles["qkv_warps"],
        **_pdl(x, tiles))


def attend(stage: Stage, i: int, x: torch.Tensor, pos: torch.Tensor, span: int, s: Scratch, tiles: dict,
           at: int = 0) -> None:
    """Attention of the token at `pos` + at over the first `span` slots and the o projection, added to x."""
    cfg = stage.cfg
    D, E, H, G = cfg.hidden_size, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    _attend_kernel[(G, s.n_split)](s.q, stage.k_caches[i], stage.v_caches[i], pos, at, s.acc, s.m, s.l, stage.max_len,
                                   span, E ** -0.5, E=E, R=H // G, RP=ROWS, PER=tiles["attn_slots"],
                                   BLOCK=tiles["attn_block"], **_pdl(x, tiles))
    _o_kernel[(triton.cdiv(D, tiles["o_rows"]),)](s.acc, s.m, s.l, stage.layers[i].self_attn.o_proj.weight, x,
                                                  s.n_split, D=D, E=E, R=H // G, RP=ROWS, HE=H * E,
                                                  BLOCK_N=tiles["o_rows"], BLOCK_K=min(1024, _pow2(H * E)),
                                                  **_pdl(x, tiles))


def gate_up(stage: Stage, i: int, x: torch.Tensor, s: Scratch, tiles: dict) -> None:
    """silu(gate) * up of layer i's normalised x, into s.act."""
    cfg, layer = stage.cfg, stage.layers[i]
    D, F = cfg.hidden_size, cfg.intermediate_size
    norm = layer.post_attention_layernorm
    _gate_up_kernel[(triton.cdiv(F, tiles["gate_up_rows"]),)](
        x, norm.weight, layer.mlp.gate_up[0], s.act, norm.eps, D=D, F=F, BLOCK_N=tiles["gate_up_rows"],
        BLOCK_K=min(1024, _pow2(D)), num_warps=tiles["gate_up_warps"], **_pdl(x, tiles))


def down(stage: Stage, i: int, x: torch.Tensor, s: Scratch, tiles: dict) -> None:
    """Layer i's down projection of s.act, added to x."""
    D, F = stage.cfg.hidden_size, stage.cfg.intermediate_size
    _down_kernel[(triton.cdiv(D, tiles["down_rows"]),)](
        s.act, stage.layers[i].mlp.down_proj.weight, x, D=D, F=F, BLOCK_N=tiles["down_rows"],
        BLOCK_K=min(tiles["down_cols"], _pow2(F)), num_warps=tiles["down_warps"], **_pdl(x, tiles))


def head(stage: Stage, x: torch.Tensor, s: Scratch, tiles: dict, logits: torch.Tensor | None = None) -> None:
    """Each block of rows' best logit and its id into s.best, s.at (ids < s.vocab); the logits (fp32) also
    into `logits` [s.vocab] if given."""
    D = stage.cfg.hidden_size
    _head_kernel[(s.best.numel(),)](x, stage.norm.weight, stage.lm_head.weight, s.best, s.at,
                                    s.best if logits is None else logits, s.vocab, stage.norm.eps, D=D,
                                    BLOCK_N=tiles["head_rows"], BLOCK_K=min(1024, _pow2(D)), KEEP=logits is not None,
                                    num_warps=tiles["head_warps"], **_pdl(x, tiles))


def pick(stage: Stage, s: Scratch, toks: torch.Tensor, j: int, tiles: dict, from_head: bool) -> None:
    """toks[j] = the head's greedy token if `from_head`; then s.x = the embedding row of toks[j]."""
    D = stage.cfg.hidden_size
    _pick_kernel[(1,)](s.best, s.at, s.best.numel(), toks, j, stage.embed_tokens.weight, s.x, D=D,
                       BLOCK=min(4096, _pow2(s.best.numel())), BLOCK_D=_pow2(D), FROM_HEAD=from_head, num_warps=8,
                       **_pdl(s.x, tiles))


def draft(stage: Stage, toks: torch.Tensor, start: torch.Tensor, out: torch.Tensor, logits: torch.Tensor | None,
          span: int, vocab: int, tiles: dict = TILES) -> None:
    """Feed toks [c + 1] from cache slot `start` [1] (the first c only fill the cache: no head), then draft
    out.numel() greedy tokens into `out` (ids < vocab; their logits into logits [k, vocab] if given),
    attending over the first `span` slots. All positions are read on the device, so a CUDA graph of this
    replays for any start; between steps the token never leaves the GPU. Needs `available(stage)`."""
    s = Scratch(stage, span, tiles, vocab)
    c, k = toks.numel() - 1, out.numel()
    pick(stage, s, toks, 0, tiles, from_head=False)
    for t in range(c + k):
        for i in range(len(stage.layers)):
            qkv(stage, i, s.x, start, s, tiles, at=t)
            attend(stage, i, s.x, start, span, s, tiles, at=t)
            gate_up(stage, i, s.x, s, tiles)
            down(stage, i, s.x, s, tiles)
        if t < c:
            pick(stage, s, toks, t + 1, tiles, from_head=False)
        else:
            head(stage, s.x, s, tiles, None if logits is None else logits[t - c])
            pick(stage, s, out, t - c, tiles, from_head=True)
