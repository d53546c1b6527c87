"""Experiment v4 (bench/NOTES.md, v12; not part of kit): NF4 x few tokens with our own K-major layout (int32 words [K/8, N], scales [K/64, N]).
Usage: python bench/results/nf4_kernel_experiment/v4_kmajor.py [--cpu] [--out F] (run from the repo root; DECODES, SPLITDEC pick variants)"""
import argparse
import itertools
import json
import os
import sys
import time

import torch

DECODES = [int(d) for d in os.environ.get('DECODES', '0,1,2').split(',') if d]
SPLITDEC = [int(d) for d in os.environ.get('SPLITDEC', '1,2').split(',') if d]

if "--cpu" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
import triton
import triton.language as tl


C = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
     0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]


@triton.jit
def _select16(idx):
    b0 = (idx & 1) != 0
    b1 = (idx & 2) != 0
    b2 = (idx & 4) != 0
    b3 = (idx & 8) != 0
    l0 = tl.where(b0, -0.6961928009986877, -1.0)
    l1 = tl.where(b0, -0.39491748809814453, -0.5250730514526367)
    l2 = tl.where(b0, -0.18477343022823334, -0.28444138169288635)
    l3 = tl.where(b0, 0.0, -0.09105003625154495)
    l4 = tl.where(b0, 0.16093020141124725, 0.07958029955625534)
    l5 = tl.where(b0, 0.33791524171829224, 0.24611230194568634)
    l6 = tl.where(b0, 0.5626170039176941, 0.44070982933044434)
    l7 = tl.where(b0, 1.0, 0.7229568362236023)
    m0 = tl.where(b1, l1, l0)
    m1 = tl.where(b1, l3, l2)
    m2 = tl.where(b1, l5, l4)
    m3 = tl.where(b1, l7, l6)
    n0 = tl.where(b2, m1, m0)
    n1 = tl.where(b2, m3, m2)
    return tl.where(b3, n1, n0)


@triton.jit
def _kernel(x_ptr, w_ptr, s_ptr, code_ptr, b_ptr, y_ptr, T, N, K,
            BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, EXPAND: tl.constexpr,
            IEEE: tl.constexpr, DECODE: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, BLOCK_T)
    kk = tl.arange(0, 64)
    n_ok, t_ok = n < N, t < T
    shift = (kk % 8) * 4
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, 64):
        k = k0 + kk
        if EXPAND:
            w8 = tl.load(w_ptr + (k0 // 8 + tl.arange(0, 8))[:, None] * N + n[None, :], mask=n_ok[None, :], other=0)
            words = tl.reshape(tl.broadcast_to(w8[:, None, :], (8, 8, BLOCK_N)), (64, BLOCK_N))
        else:
            words = tl.load(w_ptr + (k // 8)[:, None] * N + n[None, :], mask=n_ok[None, :], other=0)
        idx = (words >> shift[:, None]) & 15
        if DECODE == 0:
            vals = tl.load(code_ptr + idx)
        elif DECODE == 1:
            table = tl.broadcast_to(tl.load(code_ptr + tl.arange(0, 16))[:, None], (16, BLOCK_N))
            vals = tl.gather(table, idx, 0)
        else:
            vals = _select16(idx)
        x = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=t_ok[:, None], other=0.0)
        if IEEE:
            part = tl.dot(x, vals.to(x.dtype), input_precision="ieee")
        else:
            part = tl.dot(x, vals.to(x.dtype))
        scale = tl.load(s_ptr + (k0 // 64) * N + n, mask=n_ok, other=0.0).to(tl.float32)
        acc += part * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + t[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=t_ok[:, None] & n_ok[None, :])


@triton.jit
def _split_kernel(x_ptr, w_ptr, s_ptr, code_ptr, y_ptr, T, N, K,
                  BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, IEEE: tl.constexpr,
                  DECODE: tl.constexpr):
    # program: BLOCK_N outputs over CHUNKS 64-value chunks of K (unrolled: all loads issued together); fp32 atomics
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, BLOCK_T)
    kk = tl.arange(0, 64)
    n_ok, t_ok = n < N, t < T
    shift = (kk % 8) * 4
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    table = tl.broadcast_to(tl.load(code_ptr + tl.arange(0, 16))[:, None], (16, BLOCK_N))
    for c in tl.static_range(CHUNKS):
        k0 = (tl.program_id(1) * CHUNKS + c) * 64
        rows8 = k0 // 8 + tl.arange(0, 8)
        w8 = tl.load(w_ptr + rows8[:, None] * N + n[None, :], mask=n_ok[None, :] & (rows8 < K // 8)[:, None], other=0)
        words = tl.reshape(tl.broadcast_to(w8[:, None, :], (8, 8, BLOCK_N)), (64, BLOCK_N))
        idx = (words >> shift[:, None]) & 15
        if DECODE == 1:
            vals = tl.gather(table, idx, 0)
        else:
            vals = _select16(idx)
        k = k0 + kk
        x = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=t_ok[:, None] & (k < K)[None, :], other=0.0)
        if IEEE:
            part = tl.dot(x, vals.to(x.dtype), input_precision="ieee")
        else:
            part = tl.dot(x, vals.to(x.dtype))
        scale = tl.load(s_ptr + (k0 // 64) * N + n, mask=n_ok & (n * 0 + k0 < K), other=0.0).to(tl.float32)
        acc += part * scale[None, :]
    tl.atomic_add(y_ptr + t[:, None] * N + n[None, :], acc, mask=t_ok[:, None] & n_ok[None, :], sem="relaxed")


def split_matmul(x, packed, bias, block_n=64, warps=4, chunks=4, decode=1):
    words, scales, code = packed
    K = x.shape[-1]
    N = words.shape[1]
    x2 = x.reshape(-1, K)
    T = x2.shape[0]
    y = torch.zeros(T, N, dtype=torch.float32, device=x.device)
    _split_kernel[(triton.cdiv(N, block_n), triton.cdiv(K // 64, chunks))](
        x2, words, scales, code, y, T, N, K, BLOCK_T=max(16, triton.next_power_of_2(T)), BLOCK_N=block_n,
        CHUNKS=chunks, IEEE=x.dtype == torch.float32, DECODE=decode, num_warps=warps)
    if bias is not None:
        y += bias
    return y.to(x.dtype).view(*x.shape[:-1], N)


@triton.jit
def _byte_kernel(x_ptr, w_ptr, s_ptr, lut_ptr, y_ptr, T, N, K,
                 BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, GATHER: tl.constexpr):
    # fp16 only: a byte of the words is two values, k = 2r (low nibble) and 2r + 1 (high), looked up at once in
    # a 256-entry table of fp16 pairs; x's even and odd columns meet them in two dots
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, BLOCK_T)
    r = tl.arange(0, 32)
    n_ok, t_ok = n < N, t < T
    bshift = (r % 4) * 8
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    if GATHER:
        table = tl.broadcast_to(tl.load(lut_ptr + tl.arange(0, 256))[:, None], (256, BLOCK_N))
    for c in tl.static_range(CHUNKS):
        k0 = (tl.program_id(1) * CHUNKS + c) * 64
        rows8 = k0 // 8 + tl.arange(0, 8)
        w8 = tl.load(w_ptr + rows8[:, None] * N + n[None, :], mask=n_ok[None, :] & (rows8 < K // 8)[:, None], other=0)
        words = tl.reshape(tl.broadcast_to(w8[:, None, :], (8, 4, BLOCK_N)), (32, BLOCK_N))
        byte = (words >> bshift[:, None]) & 255
        if GATHER:
            v = tl.gather(table, byte, 0)
        else:
            v = tl.load(lut_ptr + byte)
        w_even = (v & 65535).to(tl.int16).to(tl.float16, bitcast=True)
        w_odd = (v >> 16).to(tl.int16).to(tl.float16, bitcast=True)
        ke = k0 + 2 * r
        xm = t_ok[:, None] & (ke < K)[None, :]
        x_even = tl.load(x_ptr + t[:, None] * K + ke[None, :], mask=xm, other=0.0)
        x_odd = tl.load(x_ptr + t[:, None] * K + ke[None, :] + 1, mask=xm, other=0.0)
        part = tl.dot(x_even, w_even) + tl.dot(x_odd, w_odd)
        scale = tl.load(s_ptr + (k0 // 64) * N + n, mask=n_ok & (n * 0 + k0 < K), other=0.0).to(tl.float32)
        acc += part * scale[None, :]
    tl.atomic_add(y_ptr + t[:, None] * N + n[None, :], acc, mask=t_ok[:, None] & n_ok[None, :], sem="relaxed")


def byte_lut(code16):
    """256 int32: fp16 bits of code[b & 15] | fp16 bits of code[b >> 4] << 16."""
    bits = code16.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    b = torch.arange(256, device=code16.device)
    lut = bits[b & 15] | (bits[b >> 4] << 16)
    return torch.where(lut >= 2 ** 31, lut - 2 ** 32, lut).to(torch.int32)


def byte_matmul(x, packed, bias, block_n=64, warps=4, chunks=4, gather=1):
    words, scales, code = packed
    K = x.shape[-1]
    N = words.shape[1]
    x2 = x.reshape(-1, K)
    T = x2.shape[0]
    lut = _LUT.get(code.device)
    if lut is None:
        lut = _LUT[code.device] = byte_lut(code)
    y = torch.zeros(T, N, dtype=torch.float32, device=x.device)
    _byte_kernel[(triton.cdiv(N, block_n), triton.cdiv(K // 64, chunks))](
        x2, words, scales, lut, y, T, N, K, BLOCK_T=max(16, triton.next_power_of_2(T)), BLOCK_N=block_n,
        CHUNKS=chunks, GATHER=gather, num_warps=warps)
    if bias is not None:
        y += bias
    return y.to(x.dtype).view(*x.shape[:-1], N)


_LUT = {}


def repack(q, dtype):
    """bitsandbytes NF4 layer -> (words int32 [K/8, N], scales [K/64, N] dtype, code [16] dtype)."""
    import bitsandbytes.functional as F
    st = q.weight.quant_state
    N, K = q.out_features, q.in_features
    packed = q.weight.data.view(torch.uint8).reshape(N, K // 2)
    idx = torch.stack([packed >> 4, packed & 15], dim=-1).reshape(N, K).t().reshape(K // 8, 8, N).to(torch.int64)
    words = sum(idx[:, j] << (4 * j) for j in range(8))
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32).contiguous()
    absmax = st.absmax
    if st.nested:
        absmax = F.dequantize_blockwise(st.absmax, st.state2) + st.offset
    scales = absmax.float().reshape(N, K // 64).t().contiguous().to(dtype)
    return words, scales, st.code.to(dtype)


def matmul(x, packed, bias, block_n=32, warps=4, stages=3, expand=True, decode=0):
    words, scales, code = packed
    K = x.shape[-1]
    N = words.shape[1]
    x2 = x.reshape(-1, K).contiguous()
    T = x2.shape[0]
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    _kernel[(triton.cdiv(N, block_n),)](x2, words, scales, code, bias if bias is not None else y, y, T, N, K,
                                        BLOCK_T=max(16, triton.next_power_of_2(T)), BLOCK_N=block_n,
                                        HAS_BIAS=bias is not None, EXPAND=expand, IEEE=x.dtype == torch.float32, DECODE=decode,
                                        num_warps=warps, num_stages=stages)
    return y.view(*x.shape[:-1], N)


def layer(n, k, dev, dtype, gen):
    import bitsandbytes as bnb
    q = bnb.nn.Linear4bit(k, n, bias=True, compute_dtype=dtype, quant_type="nf4", device="meta")
    w = torch.empty(n, k, dtype=dtype, device=dev).normal_(0, 0.02, generator=gen)
    q.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4")
    q.bias = torch.nn.Parameter(torch.empty(n, dtype=dtype, device=dev).normal_(0, 0.02, generator=gen), requires_grad=False)
    return q.to(dev)


def check(dev, dtype, shapes, Ts):
    import bitsandbytes.functional as F
    gen = torch.Generator(device=dev).manual_seed(0)
    worst = 0.0
    for n, k in shapes:
        q = layer(n, k, dev, dtype, gen)
        p = repack(q, dtype)
        w = F.dequantize_4bit(q.weight.data, q.weight.quant_state).to(dtype)
        for T in Ts:
            x = torch.randn(T, k, device=dev, dtype=dtype, generator=gen)
            want = torch.nn.functional.linear(x.float(), w.float(), q.bias.float())
            for dec in DECODES + [10 + d for d in SPLITDEC] + ([20, 21] if dtype == torch.float16 else []):
                try:
                    if dec >= 20:
                        got = byte_matmul(x, p, q.bias, 32, 4, 2, dec - 20).float()
                    elif dec >= 10:
                        got = split_matmul(x, p, q.bias, 32, 4, 2, dec - 10).float()
                    else:
                        got = matmul(x, p, q.bias, decode=dec).float()
                except Exception as e:
                    print(f"check decode={dec}: {type(e).__name__} {str(e)[:300]}", flush=True)
                    continue
                rel = ((got - want).abs().max() / want.abs().max()).item()
                worst = max(worst, rel)
                print(f"check {n}x{k} T={T} decode={dec}: rel {rel:.2e}", flush=True)
    return worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out", default="nf4x.json")
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    if a.cpu:
        print("worst", check("cpu", torch.float32, [(96, 128), (64, 192)], [1, 3, 9]))
        print("worst fp16", check("cpu", torch.float16, [(96, 128), (64, 192)], [1, 9]))
        return
    torch.set_grad_enabled(False)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    res["check_rel"] = check("cuda", torch.float16, [(5120, 5120), (1024, 5120), (5120, 13824)], [1, 9])
    from bench.draft_verify import copy_bandwidth, device_time
    bw = copy_bandwidth()["gb_per_s"]
    res["bw_gbs"] = bw
    H, I, KV = 5120, 13824, 1024
    shapes = {"q": (H, H), "k": (KV, H), "v": (KV, H), "o": (H, H), "gate": (I, H), "up": (I, H), "down": (H, I)}
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [{nm: layer(n, k, "cuda", torch.float16, gen) for nm, (n, k) in shapes.items()} for _ in range(a.layers)]
    packs = [{nm: repack(q, torch.float16) for nm, q in L.items()} for L in layers]
    xs = {T: {k: torch.randn(T, k, device="cuda", dtype=torch.float16) for k in (H, I)} for T in (1, 9, 16)}

    def graph_us(fn, reps=30):
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return device_time(g.replay, reps)["median_ms"] * 1000

    def floor_us(names):
        by = sum(shapes[nm][0] * shapes[nm][1] * (0.5 + 2 / 64) for nm in names) * a.layers
        return by / bw / 1e3

    # tile sweep per shape at T=9
    groups = {}
    for nm, s in shapes.items():
        groups.setdefault(s, []).append(nm)
    best = {}
    res["sweep"] = {}
    t0 = time.time()
    for s, names in groups.items():
        rows = []
        for bn, w, st, dec in itertools.product([16, 32, 64, 128], [2, 4, 8], [2, 4], DECODES):
            def fn(names=names, bn=bn, w=w, st=st, dec=dec):
                for L, P in zip(layers, packs):
                    for nm in names:
                        matmul(xs[9][shapes[nm][1]], P[nm], L[nm].bias, bn, w, st, True, dec)
            try:
                us = graph_us(fn, 10) / a.layers / len(names)
            except Exception as e:
                rows.append({"tile": [bn, w, st, dec], "error": str(e)[:120]})
                continue
            rows.append({"tile": [bn, w, st, dec], "us": round(us, 2)})
        for bn, w, ch, dec in itertools.product([32, 64, 128], [4, 8], [2, 4, 8], SPLITDEC):
            def fn(names=names, bn=bn, w=w, ch=ch, dec=dec):
                for L, P in zip(layers, packs):
                    for nm in names:
                        split_matmul(xs[9][shapes[nm][1]], P[nm], L[nm].bias, bn, w, ch, dec)
            try:
                us = graph_us(fn, 10) / a.layers / len(names)
            except Exception as e:
                rows.append({"tile": ["split", bn, w, ch, dec], "error": str(e)[:120]})
                continue
            rows.append({"tile": ["split", bn, w, ch, dec], "us": round(us, 2)})
        for bn, w, ch, g in itertools.product([32, 64, 128], [4, 8], [2, 4, 8], [0, 1]):
            def fn(names=names, bn=bn, w=w, ch=ch, g=g):
                for L, P in zip(layers, packs):
                    for nm in names:
                        byte_matmul(xs[9][shapes[nm][1]], P[nm], L[nm].bias, bn, w, ch, g)
            try:
                us = graph_us(fn, 10) / a.layers / len(names)
            except Exception as e:
                rows.append({"tile": ["byte", bn, w, ch, g], "error": str(e)[:120]})
                continue
            rows.append({"tile": ["byte", bn, w, ch, g], "us": round(us, 2)})
        ok = [r for r in rows if "us" in r]
        b = min(ok, key=lambda r: r["us"])
        best[s] = b["tile"]
        fl = floor_us(names[:1]) / a.layers
        print(f"{s}: best {b} floor {fl:.1f} us ({time.time() - t0:.0f} s)", flush=True)
        res["sweep"][f"{s[0]}x{s[1]}"] = {"best": b, "floor_us": fl, "rows": rows}
        json.dump(res, open(a.out, "w"), indent=1)
    res["per_layer"] = {}
    fl = floor_us(shapes) / a.layers
    for T in (1, 9, 16):
        def ours():
            for L, P in zip(layers, packs):
                for nm in shapes:
                    b = best[shapes[nm]]
                    if b[0] == "byte":
                        byte_matmul(xs[T][shapes[nm][1]], P[nm], L[nm].bias, *b[1:])
                    elif b[0] == "split":
                        split_matmul(xs[T][shapes[nm][1]], P[nm], L[nm].bias, *b[1:])
                    else:
                        matmul(xs[T][shapes[nm][1]], P[nm], L[nm].bias, b[0], b[1], b[2], True, b[3])

        def theirs():
            for L in layers:
                for nm in shapes:
                    L[nm](xs[T][shapes[nm][1]])
        o, t = graph_us(ours) / a.layers, graph_us(theirs) / a.layers
        res["per_layer"][T] = {"ours_us": o, "bnb_us": t, "floor_us": fl, "ours_over_floor": o / fl}
        print(f"T={T}: ours {o:.1f} us/layer ({o / fl:.2f}x floor), bnb {t:.1f}, floor {fl:.1f}", flush=True)
    json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
