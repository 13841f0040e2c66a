"""Fused RMSNorm -> per-token symmetric INT8 codes + scale, one kernel (design §0x02A, §0x02D, 0x09E).

Semantics per row ``x[m, :]`` (arithmetic in float32 inside the kernel)::

    r      = rsqrt(mean(x^2) + eps)                (> 0, one scalar per row)
    y      = x * r * w
    amax   = r * max_k |x * w|                    (one_pass=True, the default: Σx² and max|x·w| are independent
                                                   reductions issued together)
           = max_k |y|                            (one_pass=False: two dependent reductions; equal in real
                                                   arithmetic since r > 0)
    scale  = 1                                    if amax == 0 (all-zero row; codes 0)
           = qparam_dtype(amax / 127)             otherwise (rounded to the declared qparam dtype, RNE)
    s_eff  = float32(scale)                       (the stored scale is re-read before encoding)
    codes  = rint(y / s_eff)                      (rint = round half to even) -> int8, in [-127, 127]

(Implementation: ``rint((x * w) * (r * (1 / s_eff)))`` (one-pass) or ``rint(y * (1 / s_eff))`` (two-pass) with one
reciprocal per row; either can differ from the real-arithmetic ``y / s_eff`` only when that lies within a few
float32 ulps of a .5 tie, the same order as the float32 rounding of ``y`` itself. No clip is needed: s_eff is amax
/ 127 rounded to nearest, so |y / s_eff| <= 127 (1 + 2^-11) < 127.5. The absmax is taken over the int32 bit
patterns of |v| (monotone for floats, NaN above Inf), so one integer max per element also carries NaN/Inf into the
status. The float32 ``amax`` of the two formulations differs by a few ulps at most, so ``scale`` can differ by one
qparam ulp between them; ``rmsnorm_quantize_reference`` takes the same ``one_pass`` flag and reproduces the
kernel's choice.)

Per-row status (int32 [M]):

- ``STATUS_OK = 0``
- ``STATUS_NONFINITE = 1``: the row (or ``w``) holds NaN/Inf, or a float32 intermediate overflowed
  (``sum(x^2)``; ``y`` with ``one_pass=False``; ``x * w`` or ``amax`` with ``one_pass=True``); the kernel's domain
  is |x| small enough that sum(x^2) is finite in float32 (one-pass also needs |x·w| finite, which for such x can
  fail only for |w| > ~1e19).
- ``STATUS_FTZ_UNSAFE = 2``: a nonzero row whose stored scale overflowed to Inf, or is zero / subnormal in the
  qparam dtype (it would not survive flush-to-zero consumers; design §0x02A).

Rows with a nonzero status get ``codes = 0`` and ``scale = NaN`` (poisoned, never silently usable). The wrapper
returns ``(codes, scale, status)``; when called on concrete arrays (not under ``jit``) with ``check=True`` it raises
``ValueError`` naming the rows and the problem instead. Under ``jit`` the caller must inspect ``status``.

Layouts: ``x: [..., K]`` (float32/bfloat16/float16, leading dims flattened to M rows), ``w: [K]`` float;
outputs ``codes: int8 [..., K]``, ``scale: qparam_dtype [...]``, ``status: int32 [...]``.

Backends: ``"gpu"`` (Pallas Triton; one program handles ``block_rows`` whole rows held in registers (default 1 row,
64 elements per thread: 2 warps at K = 4096, 4 at K = 8192); K is loaded as one power-of-two-wide masked tile, so
any K works; M tails are masked), also used on CPU with ``interpret=True``. Measured on an H200 (kernel time,
docs/benchmarks_w8a8.md): 3.49-3.54 TB/s at M = 16384, K = 8192 and 3.42-3.49 TB/s at K = 4096 (80-82 % of the
4.3 TB/s copy; 79.6 % in one of three runs at K = 4096). Tuning alternatives kept for measurement, none faster:
``num_programs=P`` (a persistent grid that loops over row blocks, prefetching the next), ``reload=True`` (re-read
x, w for the encode step instead of keeping them live), ``one_pass=False`` (the two-pass body, 8-11 % slower at
K = 8192);
``"tpu"`` (Mosaic BlockSpecs ``(block_rows, K)``, scale/status as ``[M, 1]``, partial edge blocks), validated only
with ``pltpu.InterpretParams()``.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from kvquant_jax.quant.tracing import Tracer as _Tracer
from pallas_kernels.backend import resolve


__all__ = [
    "STATUS_FTZ_UNSAFE",
    "STATUS_NONFINITE",
    "STATUS_OK",
    "ONE_PASS_DEFAULT",
    "rmsnorm_quantize",
    "rmsnorm_quantize_reference",
]

STATUS_OK = 0
STATUS_NONFINITE = 1
STATUS_FTZ_UNSAFE = 2
# amax formulation used when ``one_pass`` is None (kernel and reference alike); see the module docstring
ONE_PASS_DEFAULT = True  # the faster body on an H200 since the lean encode (docs/benchmarks_w8a8.md, 2026-11-30)
QMAX = 127
_F32_MAX = float(np.finfo(np.float32).max)
_X_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_Q_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


_RINT_MAGIC = 12582912.0  # 1.5 * 2**23
_RINT_MAGIC_BITS = 0x4B400000  # float32 bit pattern of _RINT_MAGIC


def _rint_to_int32(v):
    """Round-half-to-even of float32 |v| < 2**22 to int32, exactly, without a float->int conversion instruction.

    ``v + 1.5*2**23`` lands in [2**23, 2**24) where the float32 ulp is 1, so the IEEE round-to-nearest-even add does
    the rounding (the constant is even, so tie parity is kept) and the integer sits in the low mantissa bits:
    ``bits(v + C) - bits(C) == rint(v)``. (A float ``(v + C) - C`` would be folded to ``v`` by XLA's simplifier;
    the bitcast cannot be.) Two full-rate ops on every backend (Triton, Mosaic, XLA)."""
    return lax.bitcast_convert_type(v + _RINT_MAGIC, jnp.int32) - _RINT_MAGIC_BITS


def _scale_status(ss, amax, qdtype):
    """Per-row tail shared by every kernel body: ss = Σx² and amax (float32 [bm, 1]) -> stored scale (qdtype),
    status (int32), bad (status != OK) and the float32 reciprocal of the stored scale."""
    nonfinite = ~(ss <= _F32_MAX) | ~(amax <= _F32_MAX)
    zero = amax == 0.0
    ideal = jnp.where(zero, 1.0, amax / float(QMAX))
    scale = ideal.astype(qdtype)
    eff = scale.astype(jnp.float32)
    finfo = np.finfo(np.dtype(qdtype))
    ftz = ~zero & ~((eff >= float(finfo.tiny)) & (eff <= float(finfo.max)))
    status = jnp.where(nonfinite, STATUS_NONFINITE, jnp.where(ftz, STATUS_FTZ_UNSAFE, STATUS_OK)).astype(jnp.int32)
    return scale, status, status != STATUS_OK, 1.0 / eff


def _encode(v, bad):
    """float32 v = y / s_eff -> int8 codes; rows with bad status get 0.

    No clip is needed: |y| <= amax and s_eff = qparam(amax / 127) >= (amax / 127)(1 - 2^-11) (fp16 rounding; 2^-24
    for fp32), so |v| <= 127.07 (plus a few float32 ulps) and rint(v) is in [-127, 127]; zero rows have v = 0, and
    rows whose scale is not a normal qparam value are bad (zeroed). (A per-block branch that skips the select when
    no row is bad measured 12 % slower on an H200 than this select, docs/benchmarks_w8a8.md.)"""
    return jnp.where(bad, 0, _rint_to_int32(v)).astype(jnp.int8)


def _absmax_bits(v, axis):
    """max |v| over ``axis`` as float32, NaN-propagating: the max is taken over the int32 bit patterns of |v|
    (monotone for non-NaN floats; NaN patterns sort above +Inf), one integer op per element instead of a
    compare/select pair. Any NaN -> NaN, any Inf -> Inf."""
    bits = lax.bitcast_convert_type(v, jnp.int32) & jnp.int32(0x7FFFFFFF)
    return lax.bitcast_convert_type(jnp.max(bits, axis=axis, keepdims=True), jnp.float32)


def _row_math(x, w, *, k, eps, qdtype, one_pass, reload=None):
    """x: float32 [bm, kp] (padding columns are 0), w: float32 [1, kp]. Returns codes int8, scale [bm,1], status.

    ``one_pass=False``: Σx², then y = x·r·w and max|y| (two dependent reductions, y live in between).
    ``one_pass=True``: Σx² and max|x·w| are independent reductions issued together; amax = r·max|x·w| and the codes
    are (x·w)·(r/s_eff). ``reload``: optional callable returning (x, w) float32 again for the encode step (the GPU
    kernel re-reads them from L1/L2 instead of keeping them live in registers across the reductions)."""
    ss = jnp.sum(x * x, axis=1, keepdims=True)
    # the absmax is NaN-propagating (a float max may drop NaN), so one reduction gives both the absmax and the
    # finiteness of the row
    if one_pass:
        xw = x * w
        inv = lax.rsqrt(ss / float(k) + eps)
        amax = inv * _absmax_bits(xw, 1)
    else:
        inv = lax.rsqrt(ss / float(k) + eps)
        y = x * inv * w
        amax = _absmax_bits(y, 1)
    scale, status, bad, rinv = _scale_status(ss, amax, qdtype)
    if reload is not None:
        x, w = reload()
    if one_pass:
        v = (x * w if reload is not None else xw) * (inv * rinv)
    else:
        v = (x * inv * w if reload is not None else y) * rinv
    codes = _encode(v, bad)
    scale = jnp.where(bad, jnp.nan, scale).astype(qdtype)
    return codes, scale, status


# --------------------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------------------
def _gpu_kernel(x_ref, w_ref, codes_ref, scale_ref, status_ref, *, m, k, kp, bm, eps, qdtype, one_pass, reload):
    from jax.experimental.pallas import triton as plt

    mask_m = m % bm != 0
    mask_k = kp != k
    rows_ok = (pl.program_id(0) * bm + lax.broadcasted_iota(jnp.int32, (bm,), 0)) < m
    cols_ok = lax.broadcasted_iota(jnp.int32, (kp,), 0) < k
    tile_ok = rows_ok[:, None] & cols_ok[None, :]

    def load(policy):
        # distinct eviction policies keep the re-read (reload=True) from being CSE'd into the first load
        if mask_k:
            w = plt.load(w_ref.at[pl.ds(0, kp)], mask=cols_ok, other=0, eviction_policy=policy)
        elif policy is None:
            w = w_ref[...]
        else:
            w = plt.load(w_ref.at[pl.ds(0, kp)], eviction_policy=policy)
        if mask_m or mask_k:
            x = plt.load(x_ref.at[:, pl.ds(0, kp)], mask=tile_ok, other=0, eviction_policy=policy)
        elif policy is None:
            x = x_ref[...]
        else:
            x = plt.load(x_ref.at[:, pl.ds(0, kp)], eviction_policy=policy)
        return x.astype(jnp.float32), w.astype(jnp.float32)[None, :]

    x, w = load("evict_last" if reload else None)
    codes, scale, status = _row_math(x, w, k=k, eps=eps, qdtype=qdtype, one_pass=one_pass,
                                     reload=(lambda: load("evict_first")) if reload else None)
    if mask_m or mask_k:
        plt.store(codes_ref.at[:, pl.ds(0, kp)], codes, mask=tile_ok)
    else:
        codes_ref[...] = codes
    if mask_m:
        plt.store(scale_ref, scale[:, 0], mask=rows_ok)
        plt.store(status_ref, status[:, 0], mask=rows_ok)
    else:
        scale_ref[...] = scale[:, 0]
        status_ref[...] = status[:, 0]


def _gpu_persistent_kernel(x_ref, w_ref, codes_ref, scale_ref, status_ref, *, m, k, kp, bm, nprog, iters, eps,
                           qdtype, one_pass):
    """Persistent variant: program p handles row blocks p, p + nprog, ...; the next block's load is issued before the
    current block is reduced/encoded/stored (register double buffering), so every CTA keeps a row in flight."""
    from jax.experimental.pallas import triton as plt

    pid = pl.program_id(0)
    cols_ok = lax.broadcasted_iota(jnp.int32, (kp,), 0) < k
    if kp != k:
        w = plt.load(w_ref.at[pl.ds(0, kp)], mask=cols_ok, other=0)
    else:
        w = w_ref[...]
    w = w.astype(jnp.float32)[None, :]
    iota = lax.broadcasted_iota(jnp.int32, (bm,), 0)

    def rows(it):
        r0 = (pid + it * nprog) * bm
        ok = (r0 + iota) < m
        return r0, ok, ok[:, None] & cols_ok[None, :]

    def load(it):
        r0, _, tile_ok = rows(it)
        return plt.load(x_ref.at[pl.ds(r0, bm), pl.ds(0, kp)], mask=tile_ok, other=0)

    def body(it, x_cur):
        x_next = load(it + 1)  # masked off past the end
        r0, ok, tile_ok = rows(it)
        codes, scale, status = _row_math(x_cur.astype(jnp.float32), w, k=k, eps=eps, qdtype=qdtype,
                                         one_pass=one_pass)
        plt.store(codes_ref.at[pl.ds(r0, bm), pl.ds(0, kp)], codes, mask=tile_ok)
        plt.store(scale_ref.at[pl.ds(r0, bm)], scale[:, 0], mask=ok)
        plt.store(status_ref.at[pl.ds(r0, bm)], status[:, 0], mask=ok)
        return x_next

    lax.fori_loop(0, iters, body, load(0))


def _tpu_kernel(x_ref, w_ref, codes_ref, scale_ref, status_ref, *, k, eps, qdtype, one_pass):
    codes, scale, status = _row_math(
        x_ref[...].astype(jnp.float32), w_ref[...].astype(jnp.float32), k=k, eps=eps, qdtype=qdtype,
        one_pass=one_pass)
    codes_ref[...] = codes
    scale_ref[...] = scale
    status_ref[...] = status


def _next_pow2(v: int) -> int:
    return 1 << max(0, int(v) - 1).bit_length()


def _gpu_defaults(k: int) -> tuple[int, int]:
    """One row per program and 64 row elements per thread: 2 warps at K = 4096, 4 at K = 8192, 8 at 16384 (the
    measured best at K = 4096 and 8192 on an H200, docs/benchmarks_w8a8.md); at least 2, at most 16 warps."""
    kp = _next_pow2(k)
    return 1, max(2, min(16, kp // 2048))


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6, 7, 8, 9))
def _gpu_call(x2, w, eps, qdtype, block_rows, num_warps, num_programs, interpret, one_pass, reload):
    m, k = x2.shape
    kp = _next_pow2(k)
    bm_d, nw_d = _gpu_defaults(k)
    bm = block_rows or bm_d
    if bm & (bm - 1):
        raise ValueError(f"block_rows={bm} must be a power of two on the GPU/Triton path")
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt

        compiler_params = plt.CompilerParams(num_warps=num_warps or nw_d, num_stages=1)
    out_shape = [
        jax.ShapeDtypeStruct((m, k), jnp.int8),
        jax.ShapeDtypeStruct((m,), qdtype),
        jax.ShapeDtypeStruct((m,), jnp.int32),
    ]
    nblocks = pl.cdiv(m, bm)
    if num_programs:
        nprog = min(num_programs, nblocks)
        kernel = functools.partial(_gpu_persistent_kernel, m=m, k=k, kp=kp, bm=bm, nprog=nprog,
                                   iters=pl.cdiv(nblocks, nprog), eps=eps, qdtype=qdtype, one_pass=one_pass)
        return pl.pallas_call(kernel, grid=(nprog,), out_shape=out_shape, compiler_params=compiler_params,
                              interpret=interpret, name="rmsnorm_quantize_persistent")(x2, w)
    kernel = functools.partial(_gpu_kernel, m=m, k=k, kp=kp, bm=bm, eps=eps, qdtype=qdtype, one_pass=one_pass,
                               reload=reload)
    return pl.pallas_call(
        kernel,
        grid=(nblocks,),
        in_specs=[pl.BlockSpec((bm, k), lambda i: (i, 0)), pl.BlockSpec((k,), lambda i: (0,))],
        out_specs=[
            pl.BlockSpec((bm, k), lambda i: (i, 0)),
            pl.BlockSpec((bm,), lambda i: (i,)),
            pl.BlockSpec((bm,), lambda i: (i,)),
        ],
        out_shape=out_shape,
        compiler_params=compiler_params,
        interpret=interpret,
        name="rmsnorm_quantize",
    )(x2, w)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6))
def _tpu_call(x2, w, eps, qdtype, block_rows, interpret, one_pass):
    from jax.experimental.pallas import tpu as pltpu

    m, k = x2.shape
    bm = block_rows or 64
    bm = m if m <= bm else bm
    if interpret is True:
        interpret = pltpu.InterpretParams()
    kernel = functools.partial(_tpu_kernel, k=k, eps=eps, qdtype=qdtype, one_pass=one_pass)
    codes, scale, status = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, bm),),
        in_specs=[pl.BlockSpec((bm, k), lambda i: (i, 0)), pl.BlockSpec((1, k), lambda i: (0, 0))],
        out_specs=[
            pl.BlockSpec((bm, k), lambda i: (i, 0)),
            pl.BlockSpec((bm, 1), lambda i: (i, 0)),
            pl.BlockSpec((bm, 1), lambda i: (i, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((m, k), jnp.int8),
            jax.ShapeDtypeStruct((m, 1), qdtype),
            jax.ShapeDtypeStruct((m, 1), jnp.int32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="rmsnorm_quantize_tpu",
    )(x2, w.reshape(1, k))
    return codes, scale[:, 0], status[:, 0]


# --------------------------------------------------------------------------------------------------------------
# Validation and public API
# --------------------------------------------------------------------------------------------------------------
def _validate(x, weight, eps, qparam_dtype):
    x = jnp.asarray(x)
    weight = jnp.asarray(weight)
    if x.ndim < 2 or x.dtype not in _X_DTYPES:
        raise ValueError(f"rmsnorm_quantize: x must be float32/bfloat16/float16 [..., K] with ndim >= 2, "
                         f"got {x.dtype}{list(x.shape)}")
    if 0 in x.shape:
        raise ValueError(f"rmsnorm_quantize: x must be non-empty, got shape {list(x.shape)}")
    k = x.shape[-1]
    if weight.shape != (k,) or weight.dtype not in _X_DTYPES:
        raise ValueError(f"rmsnorm_quantize: weight must be a float [{k}] vector, got {weight.dtype}"
                         f"{list(weight.shape)}")
    try:
        qdtype = jnp.dtype(qparam_dtype)
    except TypeError as e:
        raise ValueError(f"rmsnorm_quantize: bad qparam_dtype {qparam_dtype!r}") from e
    if qdtype not in _Q_DTYPES:
        raise ValueError(f"rmsnorm_quantize: qparam_dtype must be float16 or float32, got {qdtype}")
    if isinstance(eps, _Tracer) or not isinstance(eps, (int, float, np.floating)):
        raise ValueError(f"rmsnorm_quantize: eps must be a static Python float, got {type(eps).__name__}")
    eps = float(eps)
    if not (np.isfinite(eps) and eps > 0):
        raise ValueError(f"rmsnorm_quantize: eps must be finite and > 0, got {eps}")
    if not isinstance(weight, _Tracer) and not np.isfinite(np.asarray(weight, np.float32)).all():
        raise ValueError("rmsnorm_quantize: weight has non-finite entries")
    return x, weight, eps, qdtype


def _check_status(codes, scale, status, check, args):
    if not check or any(isinstance(a, _Tracer) for a in (*args, status)):
        return codes, scale, status
    st = np.asarray(status).reshape(-1)
    if (st != STATUS_OK).any():
        nonfinite = np.flatnonzero(st == STATUS_NONFINITE)
        ftz = np.flatnonzero(st == STATUS_FTZ_UNSAFE)
        parts = []
        if nonfinite.size:
            parts.append(f"{nonfinite.size} non-finite row(s) (NaN/Inf input or float32 overflow), "
                         f"first {nonfinite[:8].tolist()}")
        if ftz.size:
            parts.append(f"{ftz.size} row(s) with an FTZ-unsafe stored scale (overflow/zero/subnormal in "
                         f"{scale.dtype}), first {ftz[:8].tolist()}")
        raise ValueError("rmsnorm_quantize: " + "; ".join(parts))
    return codes, scale, status


def rmsnorm_quantize(
    x: jax.Array,
    weight: jax.Array,
    *,
    eps: float = 1e-6,
    qparam_dtype: Any = jnp.float32,
    block_rows: int | None = None,
    num_warps: int | None = None,
    num_programs: int | None = None,
    backend: str | None = None,
    interpret: Any = None,
    check: bool = True,
    one_pass: bool | None = None,
    reload: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fused RMSNorm + per-token INT8 quantization. Returns ``(codes int8 [...,K], scale [...], status int32 [...])``.

    ``backend``: None (auto), ``"gpu"`` (Pallas Triton / generic interpreter) or ``"tpu"`` (Mosaic).
    ``interpret``: None -> ``default_interpret()``; True -> interpreter (TPU interpreter for ``backend="tpu"``).
    ``one_pass``: None -> ``ONE_PASS_DEFAULT``; selects the amax formulation (module docstring); the reference takes
    the same flag. ``reload``: GPU grid kernel only (not with ``num_programs``, not on TPU): re-read x and w for
    the encode step instead of keeping them in registers across the reductions (same results).
    """
    x, weight, eps, qdtype = _validate(x, weight, eps, qparam_dtype)
    one_pass = ONE_PASS_DEFAULT if one_pass is None else bool(one_pass)
    reload = bool(reload)
    backend, interpret = resolve(backend, interpret, "rmsnorm_quantize: ")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if reload and (backend == "tpu" or num_programs):
        raise ValueError("rmsnorm_quantize: reload=True is only supported by the GPU grid kernel (no num_programs)")
    if backend == "tpu":
        codes, scale, status = _tpu_call(x2, weight, eps, qdtype, block_rows, interpret, one_pass)
    else:
        codes, scale, status = _gpu_call(x2, weight, eps, qdtype, block_rows, num_warps, num_programs, interpret,
                                         one_pass, reload)
    out = codes.reshape(*lead, k), scale.reshape(lead), status.reshape(lead)
    return _check_status(*out, check, (x, weight))


@functools.partial(jax.jit, static_argnames=("k", "eps", "qdtype", "one_pass"))
def _reference_math(x2, weight, *, k, eps, qdtype, one_pass):
    return _row_math(x2.astype(jnp.float32), weight.astype(jnp.float32)[None, :], k=k, eps=eps, qdtype=qdtype,
                     one_pass=one_pass)


def rmsnorm_quantize_reference(
    x: jax.Array,
    weight: jax.Array,
    *,
    eps: float = 1e-6,
    qparam_dtype: Any = jnp.float32,
    block_rows: int | None = None,
    num_warps: int | None = None,
    num_programs: int | None = None,
    backend: str | None = None,
    interpret: Any = None,
    check: bool = True,
    one_pass: bool | None = None,
    reload: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Plain-JAX (unfused, float32) reference with the kernel's semantics (``one_pass`` as for the kernel); tuning
    arguments (``reload`` included) are ignored."""
    del block_rows, num_warps, num_programs, backend, interpret, reload
    x, weight, eps, qdtype = _validate(x, weight, eps, qparam_dtype)
    one_pass = ONE_PASS_DEFAULT if one_pass is None else bool(one_pass)
    lead, k = x.shape[:-1], x.shape[-1]
    codes, scale, status = _reference_math(x.reshape(-1, k), weight, k=k, eps=eps, qdtype=qdtype, one_pass=one_pass)
    out = codes.reshape(*lead, k), scale.reshape(lead), status.reshape(lead)
    return _check_status(*out, check, (x, weight))
