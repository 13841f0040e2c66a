"""W8A8 integer GEMM with a per-token x per-channel epilogue, and affine zero-point expansion (0x02B, 0x02C).

Symmetric (the online path)::

    acc[m, n]   = sum_k Qx[m, k] * Qw[n, k]                  int8 x int8 -> int32 (preferred_element_type)
    Y_hat[m, n] = s_x[m] * s_w[n] * acc[m, n]  (+ bias[n])     float32 epilogue, an outer product of scales

Affine (uint8 codes ``u`` with integer zero-points ``z``, ``x ~= (u - z) * s``, as made by
``quantize_affine(..., zero="int")``).  The uint8 codes are re-centred to int8 ``v = u - 128`` so the reduction
still runs on an int8 x int8 dot; with ``z' = z - 128``::

    sum_k (vx - z'x)(vw - z'w) = sum_k vx vw - z'w[n] * rowsum_x[m] - z'x[m] * colsum_w[n] + K z'x[m] z'w[n]

Accumulator width: the exact result fits int32 when ``K * 255 * 255 < 2**31`` for the affine path
(``K <= 33025``) and ``K * 127 * 127 < 2**31`` for the narrow symmetric path (``K <= 133143``); larger ``K``
raises ``ValueError``.  Partial sums of the affine expansion may exceed int32 transiently; integer arithmetic is
modular (two's complement), so the wrap-around cancels and the final in-range result is exact.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

INT32_MAX = 2 ** 31 - 1
MAX_K_SYMMETRIC = INT32_MAX // (127 * 127)
MAX_K_AFFINE = INT32_MAX // (255 * 255)


def _check_operands(a, b, dtype, max_k: int, what: str):
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.dtype != dtype or b.dtype != dtype:
        raise ValueError(f"{what}: expected {jnp.dtype(dtype).name} operands, got {a.dtype} and {b.dtype}")
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"{what}: expected x [M, K] and w [N, K], got {a.shape} and {b.shape}")
    if 0 in a.shape or 0 in b.shape:
        raise ValueError(f"{what}: empty operand {a.shape} / {b.shape}")
    if a.shape[1] > max_k:
        raise ValueError(f"{what}: K={a.shape[1]} exceeds {max_k}, the int32 accumulator bound")
    return a, b


def _check_vector(v, n: int, name: str, what: str, integer: bool = False) -> jax.Array:
    v = jnp.asarray(v)
    if v.shape != (n,):
        raise ValueError(f"{what}: {name} must have shape ({n},), got {v.shape}")
    if integer and not jnp.issubdtype(v.dtype, jnp.integer):
        raise ValueError(f"{what}: {name} must be an integer zero-point array, got dtype {v.dtype}")
    return v


@jax.jit
def _dot_i32(a: jax.Array, b: jax.Array) -> jax.Array:
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)


def int8_matmul_i32(x_q, w_q) -> jax.Array:
    """``x_q int8 [M, K] @ w_q int8 [N, K]^T`` accumulated in int32 -> ``[M, N]``."""
    x_q, w_q = _check_operands(x_q, w_q, jnp.int8, MAX_K_SYMMETRIC, "int8_matmul_i32")
    return _dot_i32(x_q, w_q)


def _epilogue(acc, x_scale, w_scale, bias, out_dtype, what):
    m, n = acc.shape
    xs = _check_vector(x_scale, m, "x_scale", what)
    ws = _check_vector(w_scale, n, "w_scale", what)
    b = None if bias is None else _check_vector(bias, n, "bias", what)
    return _epilogue_core(acc, xs, ws, b, out_dtype=np.dtype(out_dtype))


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def _epilogue_core(acc, x_scale, w_scale, bias, *, out_dtype):
    y = acc.astype(jnp.float32) * x_scale.astype(jnp.float32)[:, None] * w_scale.astype(jnp.float32)[None, :]
    if bias is not None:
        y = y + bias.astype(jnp.float32)[None, :]
    return y.astype(out_dtype)


def w8a8_linear(x_q, x_scale, w_q, w_scale, bias=None, out_dtype=jnp.float32) -> jax.Array:
    """Symmetric W8A8 linear: ``acc_i32 * x_scale[:, None] * w_scale[None, :] (+ bias)``.

    x_q: int8 ``[M, K]`` per-token codes; x_scale: ``[M]``; w_q: int8 ``[N, K]`` per-output-channel codes;
    w_scale: ``[N]``; bias: optional ``[N]``.  Returns ``[M, N]`` in ``out_dtype``.
    """
    return _epilogue(int8_matmul_i32(x_q, w_q), x_scale, w_scale, bias, out_dtype, "w8a8_linear")


def affine_matmul_i32(x_u, x_zero, w_u, w_zero) -> jax.Array:
    """Exact ``sum_k (x_u - x_zero[m]) * (w_u - w_zero[n])`` in int32 via an int8 dot plus row/column sums.

    x_u: uint8 ``[M, K]``; x_zero: integer ``[M]`` in [0, 255]; w_u: uint8 ``[N, K]``; w_zero: integer ``[N]``.
    """
    what = "affine_matmul_i32"
    x_u, w_u = _check_operands(x_u, w_u, jnp.uint8, MAX_K_AFFINE, what)
    m, n = x_u.shape[0], w_u.shape[0]
    zx = _check_vector(x_zero, m, "x_zero", what, integer=True)
    zw = _check_vector(w_zero, n, "w_zero", what, integer=True)
    return _affine_matmul_core(x_u, zx, w_u, zw)


@jax.jit
def _affine_matmul_core(x_u, x_zero, w_u, w_zero):
    k = x_u.shape[1]
    zx = x_zero.astype(jnp.int32) - jnp.int32(128)
    zw = w_zero.astype(jnp.int32) - jnp.int32(128)
    vx = (x_u.astype(jnp.int32) - jnp.int32(128)).astype(jnp.int8)
    vw = (w_u.astype(jnp.int32) - jnp.int32(128)).astype(jnp.int8)
    row_sum_x = jnp.sum(vx, axis=1, dtype=jnp.int32)          # [M]
    col_sum_w = jnp.sum(vw, axis=1, dtype=jnp.int32)          # [N]
    return (_dot_i32(vx, vw) - zw[None, :] * row_sum_x[:, None] - zx[:, None] * col_sum_w[None, :]
            + jnp.int32(k) * zx[:, None] * zw[None, :])


def affine_w8a8_linear(x_u, x_scale, x_zero, w_u, w_scale, w_zero, bias=None, out_dtype=jnp.float32) -> jax.Array:
    """Affine W8A8 linear: ``affine_matmul_i32(...) * x_scale[:, None] * w_scale[None, :] (+ bias)``."""
    acc = affine_matmul_i32(x_u, x_zero, w_u, w_zero)
    return _epilogue(acc, x_scale, w_scale, bias, out_dtype, "affine_w8a8_linear")
