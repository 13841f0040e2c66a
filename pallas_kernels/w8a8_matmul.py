"""W8A8 / W4A8 integer GEMM with a fused per-token x per-channel dequantization epilogue (design §0x02B-0x02D, 0x09E).

Math (all variants)::

    acc[m, n] = sum_k (q_x[m, k] - z_x[m]) * q_w[n, k]                  (exact, int32)
              = sum_k q_x[m, k] * q_w[n, k]  -  z_x[m] * w_sum[n]       (row/column-sum correction, §0x02C)
    y[m, n]   = float32(acc[m, n]) * (s_x[m] * s_w[n]) + bias[n]        (float32 epilogue, then cast to out_dtype)

with ``z_x = 0`` for the symmetric variant and ``w_sum[n] = sum_k q_w[n, k]`` (a weight-only quantity: pass it
precomputed in serving; it is derived from the weights when omitted). Weights are symmetric (no weight zero-point).

Operand layouts (the kernel ABI of this file):

- ``x_q: int8 [M, K]`` activation codes, row-major (K contiguous).
- ``w_q: int8 [N, K]`` weight codes, **[N, K] row-major** (K contiguous, PyTorch ``Linear.weight`` layout). Both
  operands are K-major, which is the layout Hopper's integer wgmma wants for both operands.
- ``w_packed: uint8 [N, K // 2]`` (W4A8): two 4-bit codes per byte along K; element ``k`` sits at bit offset
  ``4 * (k % 2)`` of byte ``k // 2`` (little-endian nibbles), stored offset-binary ``u = q + 8`` (architecture.md
  "Packing"). The kernel decodes ``q = u - 8`` to int8 in registers and feeds the same int8 dot.
- ``x_scale: [M]``, ``w_scale: [N]`` (fp16/bf16/fp32, cast to fp32), ``bias: [N]`` float or None,
  ``x_zero_point: int32 [M]`` in [-128, 127] or None, ``w_sum: int32 [N]`` or None.

Backends (``backend=None`` picks from :func:`pallas_kernels.backend.platform`):

- ``"gpu"``: Pallas Triton. 1-D grid over (M/bm) x (N/bn) output tiles in grouped ("swizzled") order for L2
  reuse; each program loops over K in ``block_k`` chunks (``fori_loop`` -> ``scf.for``, software-pipelined by
  Triton with ``num_stages``), accumulates in int32 registers and runs the epilogue before a single store.
  W4A8 decode (``w4_mode``): ``"planes"`` (default; measured slightly faster on an H200) views the activations as
  int16 pairs, splits them into even/odd-k int8 halves by shifts and runs two dots (K = bk/2) against the
  low/high nibble planes, with no register interleave; ``"interleave"`` unpacks the weight tile to int8 in K order
  (join + reshape) and runs one dot.
  **Tails**: M and N need not be multiples of the block; tail rows/columns are masked (loads read 0, stores are
  masked), no padding copies. K must be a multiple of ``block_k``: ``block_k`` is shrunk to a power of two that
  divides K (>= 32; >= 64 for W4A8); if none exists, K is zero-padded in the wrapper (a copy; zero codes add
  nothing to either the dot or ``w_sum``; packed weights are padded with 0x88, i.e. q = 0).
  On CPU this same kernel runs with ``interpret=True``.
- ``"tpu"``: Mosaic TPU BlockSpecs: grid (M/bm, N/bn, K/bk) with K innermost ("arbitrary"), int32 VMEM
  accumulator, epilogue on the last K step; edge blocks in M/N are partial blocks (Mosaic/the interpreter pad
  reads and drop out-of-range writes); K is zero-padded to a multiple of ``block_k`` if needed. W4A8 on TPU uses
  the "planes" decode. Validated only in the TPU interpreter
  (``interpret=pltpu.InterpretParams()``), not on TPU hardware.

Accumulator width: |acc| <= K * 128 * 127 (+ |z| * |w_sum| <= K * 128 * 127), so K <= 65536 keeps every term,
correction included, inside int32; larger K is rejected.

``interpret``: None -> :func:`pallas_kernels.backend.default_interpret`; True -> Pallas interpreter (for
``backend="tpu"`` the TPU interpreter ``pltpu.InterpretParams()``); an ``InterpretParams`` object is passed through.

Eager calls (concrete arrays) additionally check that scales are finite and > 0, bias is finite and zero-points
lie in [-128, 127], and raise ``ValueError`` naming the problem; under ``jit`` only static checks (dtype, shape)
run.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from kvquant_jax.quant.tracing import Tracer as _Tracer
from pallas_kernels.backend import platform, resolve


__all__ = [
    "GemmConfig",
    "GemmOptions",
    "default_config",
    "pack_int4",
    "unpack_int4",
    "w4a8_matmul",
    "w4a8_matmul_reference",
    "w8a8_matmul",
    "w8a8_matmul_reference",
]

MAX_K = 65536
_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_SCALE_DTYPES = _OUT_DTYPES


# --------------------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and Triton launch parameters. ``block_k`` counts unpacked K elements (also for W4A8)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int | None = None  # Triton only
    num_stages: int | None = None  # Triton only
    group_m: int = 8  # Triton grouped tile order (L2 reuse)
    w4_mode: str = "planes"  # W4A8 decode on the GPU path: "planes" | "interleave" (see _gpu_kernel)


def _next_pow2(v: int) -> int:
    return 1 << max(0, int(v) - 1).bit_length()


def default_config(m: int, n: int, k: int, *, backend: str, w4: bool = False) -> GemmConfig:
    """Per-backend default tiles. GPU values were measured on an H200 (JAX 0.11.2, docs/benchmarks_w8a8.md):
    decode-size M streams the weights with narrow N tiles (>= ~132 CTAs, bk up to 512); M in (64, 512] uses
    128x128x128; large M uses 128x256x128, 8 warps, 3 stages (256x128x128 was within run-to-run noise)."""
    del k
    if backend == "tpu":
        bm = m if m <= 256 else 256
        bn = n if n <= 256 else 256
        return GemmConfig(bm, bn, 512)
    mode = "planes" if w4 else "interleave"
    # GPU (Triton) and the generic interpreter: power-of-two tiles.
    if m <= 32:
        bm = 16 if m <= 16 else 32
        if -(-n // 64) >= 132:
            return GemmConfig(bm, 64, 256, num_warps=4, num_stages=4, w4_mode=mode)
        return GemmConfig(bm, 32, 512, num_warps=4, num_stages=4, w4_mode=mode)
    if m <= 64:
        return GemmConfig(64, 64, 256, num_warps=4, num_stages=4, w4_mode=mode)
    if m <= 512:
        return GemmConfig(128, 128, 128, num_warps=4, num_stages=4, w4_mode=mode)
    return GemmConfig(128, 256, 128, num_warps=8, num_stages=3, w4_mode=mode)


# --------------------------------------------------------------------------------------------------------------
# int4 packing helpers (architecture.md layout: element k at bit offset 4*(k%2) of byte k//2, u = q + 8)
# --------------------------------------------------------------------------------------------------------------
def pack_int4(q: jax.Array) -> jax.Array:
    """int8 codes in [-8, 7], shape [..., K] (K even) -> uint8 [..., K // 2] offset-binary nibbles."""
    q = jnp.asarray(q)
    if q.dtype != jnp.int8 or q.shape[-1] % 2:
        raise ValueError(f"pack_int4 expects int8 [..., K] with even K, got {q.dtype}{list(q.shape)}")
    u = (q.astype(jnp.int32) + 8).astype(jnp.uint8)
    lo = u[..., 0::2]
    hi = u[..., 1::2]
    return lo | (hi << 4)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """Inverse of :func:`pack_int4`: uint8 [..., K // 2] -> int8 [..., K] in [-8, 7]."""
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise ValueError(f"unpack_int4 expects uint8, got {packed.dtype}")
    return _decode_nibbles(packed)


def _decode_nibbles(p):
    """uint8 [R, C] -> int8 [R, 2C] with element 2j from the low nibble of byte j and 2j+1 from its high nibble."""
    lo = (p & 15).astype(jnp.int8) - 8
    hi = (p >> 4).astype(jnp.int8) - 8
    both = jnp.stack([lo, hi], axis=-1)
    return both.reshape(*p.shape[:-1], 2 * p.shape[-1])


# --------------------------------------------------------------------------------------------------------------
# Validation (shared by kernel wrappers and references)
# --------------------------------------------------------------------------------------------------------------
def _is_concrete(*arrays) -> bool:
    return not any(isinstance(a, _Tracer) for a in arrays if a is not None)


def _validate(x_q, x_scale, w, w_scale, bias, x_zero_point, w_sum, out_dtype, *, w4: bool):
    name = "w4a8_matmul" if w4 else "w8a8_matmul"
    x_q = jnp.asarray(x_q)
    w = jnp.asarray(w)
    if x_q.ndim != 2 or x_q.dtype != jnp.int8:
        raise ValueError(f"{name}: x_q must be int8 [M, K], got {x_q.dtype}{list(x_q.shape)}")
    m, k = x_q.shape
    if m == 0 or k == 0:
        raise ValueError(f"{name}: x_q must be non-empty, got shape {list(x_q.shape)}")
    if k > MAX_K:
        raise ValueError(f"{name}: K={k} exceeds {MAX_K}; the int32 accumulator could overflow")
    if w4:
        if w.ndim != 2 or w.dtype != jnp.uint8:
            raise ValueError(f"{name}: w_packed must be uint8 [N, K // 2], got {w.dtype}{list(w.shape)}")
        if k % 2:
            raise ValueError(f"{name}: K must be even for packed int4 weights, got K={k}")
        if w.shape[1] != k // 2:
            raise ValueError(f"{name}: w_packed K/2 dimension {w.shape[1]} does not match x_q K={k}")
    else:
        if w.ndim != 2 or w.dtype != jnp.int8:
            raise ValueError(f"{name}: w_q must be int8 [N, K] (K contiguous), got {w.dtype}{list(w.shape)}")
        if w.shape[1] != k:
            raise ValueError(f"{name}: w_q K dimension {w.shape[1]} does not match x_q K={k}")
    n = w.shape[0]
    if n == 0:
        raise ValueError(f"{name}: N must be non-empty")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"{name}: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")

    def _vec(v, length, what, dtypes, kind):
        v = jnp.asarray(v)
        if v.shape != (length,) or v.dtype not in dtypes:
            raise ValueError(f"{name}: {what} must be {kind} [{length}], got {v.dtype}{list(v.shape)}")
        return v

    x_scale = _vec(x_scale, m, "x_scale", _SCALE_DTYPES, "float")
    w_scale = _vec(w_scale, n, "w_scale", _SCALE_DTYPES, "float")
    if bias is not None:
        bias = _vec(bias, n, "bias", _SCALE_DTYPES, "float")
    if x_zero_point is not None:
        x_zero_point = _vec(x_zero_point, m, "x_zero_point", (jnp.dtype(jnp.int32),), "int32")
    if w_sum is not None:
        if x_zero_point is None:
            raise ValueError(f"{name}: w_sum is only used with x_zero_point")
        w_sum = _vec(w_sum, n, "w_sum", (jnp.dtype(jnp.int32),), "int32")

    if _is_concrete(x_scale, w_scale, bias, x_zero_point):
        for what, s in (("x_scale", x_scale), ("w_scale", w_scale)):
            s64 = np.asarray(s, dtype=np.float64)
            if not np.isfinite(s64).all():
                raise ValueError(f"{name}: {what} has non-finite entries at {np.flatnonzero(~np.isfinite(s64))[:8]}")
            if not (s64 > 0).all():
                raise ValueError(f"{name}: {what} must be > 0, bad entries at {np.flatnonzero(~(s64 > 0))[:8]}")
        if bias is not None and not np.isfinite(np.asarray(bias, dtype=np.float64)).all():
            raise ValueError(f"{name}: bias has non-finite entries")
        if x_zero_point is not None:
            z = np.asarray(x_zero_point)
            if z.min() < -128 or z.max() > 127:
                raise ValueError(f"{name}: x_zero_point must lie in [-128, 127], got range [{z.min()}, {z.max()}]")
    return x_q, x_scale, w, w_scale, bias, x_zero_point, w_sum, out_dtype, (m, n, k)


def _weight_sum(w, w4):
    wq = _decode_nibbles(w) if w4 else w
    return jnp.sum(wq.astype(jnp.int32), axis=1, dtype=jnp.int32)


# --------------------------------------------------------------------------------------------------------------
# Shared tile math
# --------------------------------------------------------------------------------------------------------------
_NT = (((1,), (1,)), ((), ()))  # contract the K axis of [rows, K] x [cols, K]


def _epilogue(acc, sx, sw, bias, zx, wsum, out_dtype):
    """acc int32 [bm, bn]; sx/zx [bm, 1]; sw/bias/wsum [1, bn] (already float32 / int32)."""
    if zx is not None:
        acc = acc - zx * wsum
    y = acc.astype(jnp.float32) * (sx * sw)
    if bias is not None:
        y = y + bias
    return y.astype(out_dtype)


# --------------------------------------------------------------------------------------------------------------
# GPU (Pallas Triton) kernel; also the generic interpreted kernel on CPU
# --------------------------------------------------------------------------------------------------------------
def _swizzle(pid, num_m, num_n, group_m):
    """Grouped tile order: `group_m` row-tiles share each column sweep so weight tiles stay in L2."""
    width = group_m * num_n
    group = pid // width
    first_m = group * group_m
    size_m = jnp.minimum(num_m - first_m, group_m)
    local = pid % width
    return first_m + local % size_m, local // size_m


def _split_int16_pairs(x16):
    """int16 [.., C] holding little-endian int8 pairs -> (even-k int8, odd-k int8), by arithmetic shifts."""
    x_even = lax.shift_right_arithmetic(lax.shift_left(x16, jnp.int16(8)), jnp.int16(8)).astype(jnp.int8)
    x_odd = lax.shift_right_arithmetic(x16, jnp.int16(8)).astype(jnp.int8)
    return x_even, x_odd


def _nibble_planes(p):
    """uint8 [.., C] packed -> (low-nibble codes, high-nibble codes) as int8 in [-8, 7] (k even, k odd)."""
    return (p & 15).astype(jnp.int8) - 8, (p >> 4).astype(jnp.int8) - 8


def _split_refs(refs, has_bias: bool, has_zp: bool):
    """Kernel refs in call order -> ``((x, w, sx, sw, bias | None, zx | None, wsum | None), output refs)``."""
    refs = list(refs)
    pos = 4
    bias_ref = zx_ref = wsum_ref = None
    if has_bias:
        bias_ref = refs[pos]
        pos += 1
    if has_zp:
        zx_ref, wsum_ref = refs[pos], refs[pos + 1]
        pos += 2
    return (*refs[:4], bias_ref, zx_ref, wsum_ref), refs[pos:]


def _gpu_kernel(*refs, m, n, nk, bm, bn, bk, w4, w4_planes, has_bias, has_zp, num_m, num_n, group_m, out_dtype):
    """W4A8 decodes: "interleave" unpacks the weight tile to int8 [bn, bk] in K order (join + reshape) and runs one
    dot; "planes" keeps the nibble planes apart and splits the activation tile (viewed as int16 pairs) into even/odd
    k by shifts, then runs two dots of K = bk/2 (no register interleave)."""
    from jax.experimental.pallas import triton as plt

    (x_ref, w_ref, sx_ref, sw_ref, bias_ref, zx_ref, wsum_ref), rest = _split_refs(refs, has_bias, has_zp)
    o_ref = rest[0]

    pid_m, pid_n = _swizzle(pl.program_id(0), num_m, num_n, group_m)
    mask_m = m % bm != 0
    mask_n = n % bn != 0
    rows_ok = (pid_m * bm + lax.broadcasted_iota(jnp.int32, (bm,), 0)) < m
    cols_ok = (pid_n * bn + lax.broadcasted_iota(jnp.int32, (bn,), 0)) < n
    wk = bk // 2 if w4 else bk  # K extent of one weight tile in stored elements
    xk_w = bk // 2 if w4_planes else bk  # K extent of one activation tile in stored elements

    def load_rows(ref, idx, ok, width, masked):
        if not masked:
            return ref[idx]
        return plt.load(ref.at[idx], mask=jnp.broadcast_to(ok[:, None], (ok.shape[0], width)), other=0)

    def body(i, acc):
        xk = pl.multiple_of(i * xk_w, xk_w)
        wk0 = pl.multiple_of(i * wk, wk)
        x = load_rows(x_ref, (slice(None), pl.ds(xk, xk_w)), rows_ok, xk_w, mask_m)
        w = load_rows(w_ref, (slice(None), pl.ds(wk0, wk)), cols_ok, wk, mask_n)
        if w4_planes:
            x_even, x_odd = _split_int16_pairs(x)
            w_lo, w_hi = _nibble_planes(w)
            acc = acc + lax.dot_general(x_even, w_lo, _NT, preferred_element_type=jnp.int32)
            return acc + lax.dot_general(x_odd, w_hi, _NT, preferred_element_type=jnp.int32)
        if w4:
            w = _decode_nibbles(w)
        return acc + lax.dot_general(x, w, _NT, preferred_element_type=jnp.int32)

    acc = lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), jnp.int32))

    def load_vec(ref, ok, masked):
        if not masked:
            return ref[...]
        return plt.load(ref, mask=ok, other=0)

    sx = load_vec(sx_ref, rows_ok, mask_m)[:, None]
    sw = load_vec(sw_ref, cols_ok, mask_n)[None, :]
    bias = load_vec(bias_ref, cols_ok, mask_n)[None, :] if has_bias else None
    zx = load_vec(zx_ref, rows_ok, mask_m)[:, None] if has_zp else None
    wsum = load_vec(wsum_ref, cols_ok, mask_n)[None, :] if has_zp else None
    y = _epilogue(acc, sx, sw, bias, zx, wsum, out_dtype)
    if mask_m or mask_n:
        plt.store(o_ref, y, mask=rows_ok[:, None] & cols_ok[None, :])
    else:
        o_ref[...] = y


def _pick_block_k(k: int, pref: int, minimum: int) -> tuple[int, int]:
    """Largest power of two <= pref dividing k (>= minimum); else (pref, k padded up to a multiple of pref)."""
    bk = pref
    while bk >= minimum:
        if k % bk == 0:
            return bk, k
        bk //= 2
    return pref, -(-k // pref) * pref


def _pad_k(x_q, w, k, kp, w4):
    if kp == k:
        return x_q, w
    x_q = jnp.pad(x_q, ((0, 0), (0, kp - k)))
    if w4:
        w = jnp.pad(w, ((0, 0), (0, (kp - k) // 2)), constant_values=np.uint8(0x88))
    else:
        w = jnp.pad(w, ((0, 0), (0, kp - k)))
    return x_q, w


@functools.partial(jax.jit, static_argnums=(7, 8, 9, 10))
def _gpu_call(x_q, sx, w, sw, bias, zx, wsum, out_dtype, cfg: GemmConfig, interpret, w4):
    m, k = x_q.shape
    n = w.shape[0]
    bm, bn = cfg.block_m, cfg.block_n
    for v, what in ((bm, "block_m"), (bn, "block_n"), (cfg.block_k, "block_k")):
        if v & (v - 1):
            raise ValueError(f"{what}={v} must be a power of two on the GPU/Triton path")
    bk, kp = _pick_block_k(k, cfg.block_k, 64 if w4 else 32)
    x_q, w = _pad_k(x_q, w, k, kp, w4)
    nk = kp // bk
    w4_planes = w4 and cfg.w4_mode == "planes"
    if w4 and cfg.w4_mode not in ("interleave", "planes"):
        raise ValueError(f"w4_mode must be 'interleave' or 'planes', got {cfg.w4_mode!r}")
    if w4_planes:
        x_q = lax.bitcast_convert_type(x_q.reshape(m, kp // 2, 2), jnp.int16)
    num_m, num_n = pl.cdiv(m, bm), pl.cdiv(n, bn)
    group_m = max(1, min(cfg.group_m, num_m))
    kw = kp // 2 if w4 else kp

    def tile_m(pid):
        return _swizzle(pid, num_m, num_n, group_m)[0]

    def tile_n(pid):
        return _swizzle(pid, num_m, num_n, group_m)[1]

    in_specs = [
        pl.BlockSpec((bm, kp // 2 if w4_planes else kp), lambda p: (tile_m(p), 0)),
        pl.BlockSpec((bn, kw), lambda p: (tile_n(p), 0)),
        pl.BlockSpec((bm,), lambda p: (tile_m(p),)),
        pl.BlockSpec((bn,), lambda p: (tile_n(p),)),
    ]
    args = [x_q, w, sx, sw]
    if bias is not None:
        in_specs.append(pl.BlockSpec((bn,), lambda p: (tile_n(p),)))
        args.append(bias)
    if zx is not None:
        in_specs += [pl.BlockSpec((bm,), lambda p: (tile_m(p),)), pl.BlockSpec((bn,), lambda p: (tile_n(p),))]
        args += [zx, wsum]
    kernel = functools.partial(
        _gpu_kernel, m=m, n=n, nk=nk, bm=bm, bn=bn, bk=bk, w4=w4, w4_planes=w4_planes, has_bias=bias is not None,
        has_zp=zx is not None, num_m=num_m, num_n=num_n, group_m=group_m, out_dtype=out_dtype)
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt

        compiler_params = plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return pl.pallas_call(
        kernel,
        grid=(num_m * num_n,),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda p: (tile_m(p), tile_n(p))),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=compiler_params,
        interpret=interpret,
        name="w4a8_matmul" if w4 else "w8a8_matmul",
    )(*args)


# --------------------------------------------------------------------------------------------------------------
# TPU (Mosaic) kernel
# --------------------------------------------------------------------------------------------------------------
def _tpu_kernel(*refs, w4, has_bias, has_zp, out_dtype):
    (x_ref, w_ref, sx_ref, sw_ref, bias_ref, zx_ref, wsum_ref), rest = _split_refs(refs, has_bias, has_zp)
    o_ref, acc_ref = rest[0], rest[1]
    kstep = pl.program_id(2)

    @pl.when(kstep == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    if w4:
        # x_ref holds int16 pairs (x[2j] in the low byte, x[2j+1] in the high byte, little-endian).
        x_even, x_odd = _split_int16_pairs(x_ref[...])
        w_lo, w_hi = _nibble_planes(w_ref[...])
        part = lax.dot_general(x_even, w_lo, _NT, preferred_element_type=jnp.int32)
        part = part + lax.dot_general(x_odd, w_hi, _NT, preferred_element_type=jnp.int32)
    else:
        part = lax.dot_general(x_ref[...], w_ref[...], _NT, preferred_element_type=jnp.int32)
    acc_ref[...] += part

    @pl.when(kstep == pl.num_programs(2) - 1)
    def _finish():
        bias = bias_ref[...] if has_bias else None
        zx = zx_ref[...] if has_zp else None
        wsum = wsum_ref[...] if has_zp else None
        o_ref[...] = _epilogue(acc_ref[...], sx_ref[...], sw_ref[...], bias, zx, wsum, out_dtype)


@functools.partial(jax.jit, static_argnums=(7, 8, 9, 10))
def _tpu_call(x_q, sx, w, sw, bias, zx, wsum, out_dtype, cfg: GemmConfig, interpret, w4):
    from jax.experimental.pallas import tpu as pltpu

    m, k = x_q.shape
    n = w.shape[0]
    bm, bn = min(cfg.block_m, m), min(cfg.block_n, n)
    step = 256 if w4 else 128
    bk = max(step, cfg.block_k // step * step)
    if k <= bk:
        bk = -(-k // step) * step
    kp = -(-k // bk) * bk
    x_q, w = _pad_k(x_q, w, k, kp, w4)
    if w4:
        x_q = lax.bitcast_convert_type(x_q.reshape(m, kp // 2, 2), jnp.int16)
    xk = bk // 2 if w4 else bk
    grid = (pl.cdiv(m, bm), pl.cdiv(n, bn), kp // bk)
    in_specs = [
        pl.BlockSpec((bm, xk), lambda i, j, s: (i, s)),
        pl.BlockSpec((bn, bk // 2 if w4 else bk), lambda i, j, s: (j, s)),
        pl.BlockSpec((bm, 1), lambda i, j, s: (i, 0)),
        pl.BlockSpec((1, bn), lambda i, j, s: (0, j)),
    ]
    args = [x_q, w, sx.reshape(m, 1), sw.reshape(1, n)]
    if bias is not None:
        in_specs.append(pl.BlockSpec((1, bn), lambda i, j, s: (0, j)))
        args.append(bias.reshape(1, n))
    if zx is not None:
        in_specs += [pl.BlockSpec((bm, 1), lambda i, j, s: (i, 0)), pl.BlockSpec((1, bn), lambda i, j, s: (0, j))]
        args += [zx.reshape(m, 1), wsum.reshape(1, n)]
    if interpret is True:
        interpret = pltpu.InterpretParams()
    kernel = functools.partial(_tpu_kernel, w4=w4, has_bias=bias is not None, has_zp=zx is not None,
                               out_dtype=out_dtype)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, s: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.int32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="w4a8_matmul_tpu" if w4 else "w8a8_matmul_tpu",
    )(*args)


# --------------------------------------------------------------------------------------------------------------
# Public wrappers
# --------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GemmOptions:
    """Per-call options of :func:`w8a8_matmul` / :func:`w4a8_matmul` (passed as keywords): tile overrides of
    :func:`default_config` (None: the default), the W4A8 decode mode (W4A8 only), ``backend`` (None: the platform's;
    "gpu" = Pallas Triton, "tpu" = Mosaic) and ``interpret`` (None: interpreter unless on a GPU / TPU)."""

    block_m: int | None = None
    block_n: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    w4_mode: str | None = None
    backend: str | None = None
    interpret: Any = None


def _matmul(x_q, x_scale, w, w_scale, bias, x_zero_point, w_sum, out_dtype, opts: GemmOptions, w4: bool):
    if opts.w4_mode is not None and not w4:
        raise TypeError("w8a8_matmul() got an unexpected keyword argument 'w4_mode' (W4A8 only)")
    x_q, x_scale, w, w_scale, bias, x_zero_point, w_sum, out_dtype, (m, n, k) = _validate(
        x_q, x_scale, w, w_scale, bias, x_zero_point, w_sum, out_dtype, w4=w4)
    backend, interpret = resolve(opts.backend, opts.interpret)
    if backend == "tpu" and platform() != "tpu" and not interpret:
        raise ValueError("backend='tpu' needs a TPU or interpret=True")
    cfg = default_config(m, n, k, backend=backend, w4=w4)
    cfg = dataclasses.replace(
        cfg,
        block_m=opts.block_m or cfg.block_m,
        block_n=opts.block_n or cfg.block_n,
        block_k=opts.block_k or cfg.block_k,
        num_warps=opts.num_warps or cfg.num_warps,
        num_stages=opts.num_stages or cfg.num_stages,
        w4_mode=opts.w4_mode or cfg.w4_mode,
    )
    sx = x_scale.astype(jnp.float32)
    sw = w_scale.astype(jnp.float32)
    bias = None if bias is None else bias.astype(jnp.float32)
    if x_zero_point is not None and w_sum is None:
        w_sum = _weight_sum(w, w4)
    call = _tpu_call if backend == "tpu" else _gpu_call
    return call(x_q, sx, w, sw, bias, x_zero_point, w_sum, out_dtype, cfg, interpret, w4)


def w8a8_matmul(x_q: jax.Array, x_scale: jax.Array, w_q: jax.Array, w_scale: jax.Array, bias: jax.Array | None = None,
                *, x_zero_point: jax.Array | None = None, w_sum: jax.Array | None = None,
                out_dtype: Any = jnp.bfloat16, **options) -> jax.Array:
    """y[M, N] = s_x[m] * s_w[n] * sum_k (x_q[m,k] - z_x[m]) * w_q[n,k] + bias[n]  (w_q is [N, K]).

    ``options``: the fields of :class:`GemmOptions` (``block_m``, ``block_n``, ``block_k``, ``num_warps``,
    ``num_stages``, ``backend``, ``interpret``)."""
    return _matmul(x_q, x_scale, w_q, w_scale, bias, x_zero_point, w_sum, out_dtype, GemmOptions(**options),
                   w4=False)


def w4a8_matmul(x_q: jax.Array, x_scale: jax.Array, w_packed: jax.Array, w_scale: jax.Array,
                bias: jax.Array | None = None, *, x_zero_point: jax.Array | None = None,
                w_sum: jax.Array | None = None, out_dtype: Any = jnp.bfloat16, **options) -> jax.Array:
    """As :func:`w8a8_matmul` with ``w_packed: uint8 [N, K // 2]`` (offset-binary int4 nibbles, see module doc);
    ``options`` also takes ``w4_mode``."""
    return _matmul(x_q, x_scale, w_packed, w_scale, bias, x_zero_point, w_sum, out_dtype, GemmOptions(**options),
                   w4=True)


def _reference(x_q, x_scale, w, w_scale, bias, x_zero_point, w_sum, out_dtype, w4):
    x_q, x_scale, w, w_scale, bias, x_zero_point, w_sum, out_dtype, _ = _validate(
        x_q, x_scale, w, w_scale, bias, x_zero_point, w_sum, out_dtype, w4=w4)
    return _reference_math(x_q, x_scale, w, w_scale, bias, x_zero_point, w_sum, out_dtype, w4)


@functools.partial(jax.jit, static_argnums=(7, 8))
def _reference_math(x_q, x_scale, w, w_scale, bias, x_zero_point, w_sum, out_dtype, w4):
    wq = _decode_nibbles(w) if w4 else w
    acc = lax.dot_general(x_q, wq, _NT, preferred_element_type=jnp.int32)
    zx = wsum = None
    if x_zero_point is not None:
        zx = x_zero_point[:, None]
        wsum = (w_sum if w_sum is not None else _weight_sum(w, w4))[None, :]
    b = None if bias is None else bias.astype(jnp.float32)[None, :]
    return _epilogue(acc, x_scale.astype(jnp.float32)[:, None], w_scale.astype(jnp.float32)[None, :], b, zx, wsum,
                     out_dtype)


def w8a8_matmul_reference(x_q, x_scale, w_q, w_scale, bias=None, *, x_zero_point=None, w_sum=None,
                          out_dtype=jnp.bfloat16, block_m=None, block_n=None, block_k=None, num_warps=None,
                          num_stages=None, backend=None, interpret=None):
    """Plain-JAX reference (XLA int8 dot -> int32, same float32 epilogue). Tuning arguments are ignored."""
    del block_m, block_n, block_k, num_warps, num_stages, backend, interpret
    return _reference(x_q, x_scale, w_q, w_scale, bias, x_zero_point, w_sum, out_dtype, w4=False)


def w4a8_matmul_reference(x_q, x_scale, w_packed, w_scale, bias=None, *, x_zero_point=None, w_sum=None,
                          out_dtype=jnp.bfloat16, block_m=None, block_n=None, block_k=None, num_warps=None,
                          num_stages=None, w4_mode=None, backend=None, interpret=None):
    """Plain-JAX reference for :func:`w4a8_matmul` (unpacks the nibbles, then as the W8A8 reference)."""
    del block_m, block_n, block_k, num_warps, num_stages, w4_mode, backend, interpret
    return _reference(x_q, x_scale, w_packed, w_scale, bias, x_zero_point, w_sum, out_dtype, w4=True)
