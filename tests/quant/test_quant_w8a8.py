"""W8A8 int8 GEMM + epilogue, and the affine zero-point expansion vs dequantize-then-matmul in float64."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvquant_jax.quant as Q
from quant_oracles import random_tensor

SHAPES = [(1, 16, 3), (5, 40, 7), (8, 128, 16)]


@given(seed=st.integers(0, 2**32 - 1), mkn=st.sampled_from(SHAPES), with_bias=st.booleans())
@settings(max_examples=20)
def test_symmetric_w8a8_matches_float64(seed, mkn, with_bias):
    m, k, n = mkn
    x = random_tensor(seed, (m, k), -1.0, 1.0)
    w = random_tensor(seed + 1, (n, k), -2.0, 0.0)
    xq, wq = Q.quantize_symmetric_rows(x), Q.quantize_symmetric_rows(w)
    acc = Q.int8_matmul_i32(xq.codes, wq.codes)
    assert acc.dtype == jnp.int32
    exact = np.asarray(xq.codes, np.int64) @ np.asarray(wq.codes, np.int64).T
    np.testing.assert_array_equal(np.asarray(acc), exact)
    bias = np.random.default_rng(seed).standard_normal(n).astype(np.float32) if with_bias else None
    y = np.asarray(Q.w8a8_linear(xq.codes, xq.scale, wq.codes, wq.scale, bias), np.float64)
    deq_x = np.asarray(xq.codes, np.float64) * np.asarray(xq.scale, np.float64)[:, None]
    deq_w = np.asarray(wq.codes, np.float64) * np.asarray(wq.scale, np.float64)[:, None]
    want = deq_x @ deq_w.T + (0 if bias is None else bias.astype(np.float64))
    # float32 epilogue: int32 -> float32 conversion and two products (a few ulps of |s_x s_w acc|); the float64
    # matmul itself carries ~1e-16 of the absolute products when the dot product cancels
    mag = np.abs(exact) * np.outer(np.asarray(xq.scale, np.float64), np.asarray(wq.scale, np.float64))
    cancel = 1e-14 * (np.abs(deq_x) @ np.abs(deq_w).T)
    assert (np.abs(y - want) <= 4e-7 * (mag + (0 if bias is None else np.abs(bias))) + cancel).all()


@given(seed=st.integers(0, 2**32 - 1), mkn=st.sampled_from(SHAPES), shift=st.sampled_from([0.0, 2.0]))
@settings(max_examples=20)
def test_affine_zero_point_expansion_equals_dequant_matmul(seed, mkn, shift):
    m, k, n = mkn
    x = random_tensor(seed, (m, k), -1.0, 1.0) + np.float32(shift)
    w = random_tensor(seed + 1, (n, k), -2.0, 0.0)
    xq = Q.quantize_affine(x, 8, qparam_dtype=jnp.float32, zero="int")
    wq = Q.quantize_affine(w, 8, qparam_dtype=jnp.float32, zero="int")
    xz, wz = np.asarray(xq.zero_or_min)[:, 0], np.asarray(wq.zero_or_min)[:, 0]
    acc = Q.affine_matmul_i32(xq.codes, xz, wq.codes, wz)
    assert acc.dtype == jnp.int32
    ux = np.asarray(xq.codes, np.int64) - xz.astype(np.int64)[:, None]
    uw = np.asarray(wq.codes, np.int64) - wz.astype(np.int64)[:, None]
    np.testing.assert_array_equal(np.asarray(acc), ux @ uw.T)                 # integer identity: exact
    xs, ws = np.asarray(xq.scale, np.float64)[:, 0], np.asarray(wq.scale, np.float64)[:, 0]
    y = np.asarray(Q.affine_w8a8_linear(xq.codes, xs.astype(np.float32), xz, wq.codes, ws.astype(np.float32), wz),
                   np.float64)
    deq_x = np.asarray(Q.dequantize_affine(*xq, zero="int"), np.float64)
    deq_w = np.asarray(Q.dequantize_affine(*wq, zero="int"), np.float64)
    want = deq_x @ deq_w.T
    mag = (np.abs(deq_x) @ np.abs(deq_w).T)
    assert (np.abs(y - want) <= 1e-6 * mag).all()


def test_extreme_codes_do_not_overflow():
    k = 2048
    xu = np.full((2, k), 255, np.uint8)
    xu[1] = 0
    wu = np.full((3, k), 0, np.uint8)
    zx, zw = np.array([0, 255]), np.array([255, 0, 128])
    want = (xu.astype(np.int64) - zx[:, None]) @ (wu.astype(np.int64) - zw[:, None]).T
    np.testing.assert_array_equal(np.asarray(Q.affine_matmul_i32(xu, zx, wu, zw)), want)
    q = np.full((1, k), -127, np.int8)
    assert int(Q.int8_matmul_i32(q, q)[0, 0]) == 127 * 127 * k


@pytest.mark.parametrize("call,match", [
    (lambda: Q.int8_matmul_i32(np.ones((2, 3), np.int16), np.ones((2, 3), np.int8)), "int8"),
    (lambda: Q.int8_matmul_i32(np.ones((2, 3), np.int8), np.ones((2, 4), np.int8)), "\\[M, K\\]"),
    (lambda: Q.int8_matmul_i32(np.ones((2, Q.w8a8.MAX_K_SYMMETRIC + 1), np.int8),
                               np.ones((1, Q.w8a8.MAX_K_SYMMETRIC + 1), np.int8)), "accumulator"),
    (lambda: Q.affine_matmul_i32(np.ones((2, Q.w8a8.MAX_K_AFFINE + 1), np.uint8), np.zeros(2, np.int32),
                                 np.ones((1, Q.w8a8.MAX_K_AFFINE + 1), np.uint8), np.zeros(1, np.int32)),
     "accumulator"),
    (lambda: Q.affine_matmul_i32(np.ones((2, 3), np.uint8), np.zeros(2), np.ones((4, 3), np.uint8),
                                 np.zeros(4, np.int32)), "integer"),
    (lambda: Q.w8a8_linear(np.ones((2, 3), np.int8), np.ones(3), np.ones((4, 3), np.int8), np.ones(4)), "x_scale"),
    (lambda: Q.affine_matmul_i32(np.ones((2, 3), np.uint8), np.zeros(3, np.int32), np.ones((4, 3), np.uint8),
                                 np.zeros(4, np.int32)), "x_zero"),
    (lambda: Q.int8_matmul_i32(np.ones((0, 3), np.int8), np.ones((2, 3), np.int8)), "empty"),
])
def test_w8a8_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_w8a8_jit():
    x = np.arange(12, dtype=np.int8).reshape(3, 4)
    y = jax.jit(Q.w8a8_linear)(x, jnp.ones(3), x, jnp.full(3, 0.5))
    np.testing.assert_allclose(np.asarray(y), x.astype(np.float64) @ x.T * 0.5)
