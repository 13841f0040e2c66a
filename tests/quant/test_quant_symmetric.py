"""Symmetric per-token / grouped quantization vs the float64 oracle (design notes 0x02A)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvquant_jax.quant as Q
from quant_oracles import OracleReject, near_half, random_tensor, symmetric_groups, symmetric_row

QDTYPES = [np.dtype(jnp.float16), np.dtype(jnp.float32), np.dtype(jnp.bfloat16)]
ROW_SHAPES = [(1, 1), (3, 7), (5, 16), (8, 33)]
UINT = {2: np.uint16, 4: np.uint32}


def bits_of(a):
    a = np.asarray(a)
    return a.view(UINT[a.dtype.itemsize])


def check_codes(got, want, quotient, slack=2e-6):
    """Codes equal the oracle's except where the real quotient sits within ``slack`` of a rounding tie."""
    got, want = np.asarray(got, np.int64), np.asarray(want, np.int64)
    diff = got != want
    allowed = near_half(quotient, slack * np.maximum(1.0, np.abs(quotient))) & (np.abs(got - want) == 1)
    assert not (diff & ~allowed).any(), (got[diff & ~allowed], want[diff & ~allowed], quotient[diff & ~allowed])


@given(seed=st.integers(0, 2**32 - 1), shape=st.sampled_from(ROW_SHAPES), bits=st.integers(2, 8),
       dtype=st.sampled_from(QDTYPES), zero_fraction=st.sampled_from([0.0, 0.3]))
def test_rows_match_oracle(seed, shape, bits, dtype, zero_fraction):
    x = random_tensor(seed, shape, -1.0, 3.0, zero_fraction)
    try:
        oracle = [symmetric_row(r, bits, dtype) for r in x]
    except OracleReject:                         # e.g. one tiny element: its fp16 scale would be subnormal
        with pytest.raises(ValueError, match="scale"):
            Q.quantize_symmetric_rows(x, bits, dtype)
        return
    got = Q.quantize_symmetric_rows(x, bits, dtype)
    qmax = 2 ** (bits - 1) - 1
    assert got.codes.dtype == jnp.int8 and got.codes.shape == shape
    assert got.scale.dtype == dtype and got.scale.shape == shape[:1]
    got = Q.SymmetricQuantized(np.asarray(got.codes), np.asarray(got.scale))
    for m in range(shape[0]):
        want_codes, want_scale = oracle[m]
        # the stored scale is bit-identical to the float64 reference's rounding
        assert bits_of(got.scale[m]) == bits_of(want_scale)
        s = float(want_scale)
        check_codes(got.codes[m], want_codes, x[m].astype(np.float64) / s)
        codes = np.asarray(got.codes[m], np.int64)
        assert np.abs(codes).max() <= qmax
        if not x[m].any():
            assert s == 1.0 and not codes.any()
            continue
        # endpoint: the largest magnitude maps to +-qmax exactly
        k = np.argmax(np.abs(x[m]))
        assert codes[k] == np.sign(x[m][k]) * qmax
        # round trip within half a step of the stored scale (plus float32 rounding of the quotient)
        err = np.abs(codes * s - x[m].astype(np.float64))
        assert (err <= s / 2 * (1 + 1e-5)).all()


@given(seed=st.integers(0, 2**32 - 1), log10=st.floats(-45.0, 36.0), dtype=st.sampled_from(QDTYPES),
       bits=st.integers(2, 8))
def test_rows_reject_exactly_when_oracle_rejects(seed, log10, dtype, bits):
    """Over a huge magnitude range: the public function raises iff the reference's stored scale is
    non-finite / zero / subnormal; otherwise it returns the oracle's scale bit-for-bit."""
    x = random_tensor(seed, (2, 9), log10, log10)
    try:
        want = [symmetric_row(r, bits, dtype)[1] for r in x]
    except OracleReject:
        with pytest.raises(ValueError, match="scale"):
            Q.quantize_symmetric_rows(x, bits, dtype)
        return
    got = Q.quantize_symmetric_rows(x, bits, dtype)
    assert (bits_of(got.scale) == bits_of(np.array(want, dtype))).all()


@pytest.mark.parametrize("bits", [3, 8])
def test_many_rows_scales_are_correctly_rounded_quotients(bits):
    """Vectorised: fp32 / fp16 stored scales of 2048 rows equal the float64 quotient rounded once (XLA rewrites a
    division by a broadcast into a reciprocal multiply, which is 1 ulp off for ~1/3 of float32 quotients)."""
    x = random_tensor(11, (2048, 8), -1.0, 3.0)
    amax = np.abs(x.astype(np.float64)).max(axis=1)
    for dtype in (np.float32, np.float16):
        got = np.asarray(Q.quantize_symmetric_rows(x, bits, dtype).scale)
        want = (amax / (2 ** (bits - 1) - 1)).astype(dtype)
        np.testing.assert_array_equal(bits_of(got), bits_of(want))


def test_fp16_scale_ties_round_to_even():
    """amax / 127 exactly on an fp16 rounding midpoint: the stored scale must round half to even."""
    f16 = np.float16
    lo = np.array([1.0, 0.5, 3.0, 1.5], f16)                       # a few fp16 values
    nxt = np.nextafter(lo, f16(np.inf))
    mid = (lo.astype(np.float64) + nxt.astype(np.float64)) / 2     # exact midpoints (12 bits)
    x = np.stack([np.array([m * 127, -0.25], np.float32) for m in mid])
    got = Q.quantize_symmetric_rows(x, 8, jnp.float16)
    even = np.where(lo.view(np.uint16) % 2 == 0, lo, nxt)
    assert (np.asarray(got.scale).view(np.uint16) == even.view(np.uint16)).all()


def test_codes_ties_to_even_and_clipping_bounds():
    s = 0.125                                                      # amax = 127 * 2**-3 -> scale exactly 2**-3
    row = np.array([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5], np.float32) * s
    got = Q.quantize_symmetric_rows(row[None], 8, jnp.float32)
    assert float(got.scale[0]) == s
    np.testing.assert_array_equal(np.asarray(got.codes[0]), [127, 0, 2, 2, 0, -2, -2, 4, 126])
    two = Q.quantize_symmetric_rows(np.array([[3.0, -1.0, 1.5, 0.5, -0.4]], np.float32), 2)
    np.testing.assert_array_equal(np.asarray(two.codes[0]), [1, -0, 0, 0, -0])  # qmax 1: scale 3
    assert float(two.scale[0]) == 3.0


def test_all_zero_rows_and_signed_zero():
    x = np.array([[0.0, -0.0, 0.0], [1.0, -2.0, 0.5]], np.float32)
    for dtype in QDTYPES:
        got = Q.quantize_symmetric_rows(x, 4, dtype)
        assert float(got.scale[0]) == 1.0 and not np.asarray(got.codes[0]).any()
        back = Q.dequantize_symmetric_rows(got.codes, got.scale)
        assert back.dtype == jnp.float32 and (np.asarray(back[0]) == 0).all()


@pytest.mark.parametrize("row,dtype,problem", [
    ([1e-3, 0.0], jnp.float16, "subnormal"),        # 1e-3/127 < fp16 tiny: FTZ-unsafe
    ([1e-9, 0.0], jnp.float16, "underflow"),        # rounds to 0 in fp16
    ([1e7, 1.0], jnp.float16, "overflow"),          # 1e7/127 > 65504
    ([1e-37, 0.0], jnp.float32, "scale"),           # 7.9e-40: subnormal fp32 (or flushed to 0)
    ([2e-45, 0.0], jnp.float32, "scale"),           # a subnormal input alone: nonzero row, zero/denormal scale
])
def test_ftz_unsafe_rows_rejected(row, dtype, problem):
    x = np.array([row, [1.0, 2.0]], np.float32)
    with pytest.raises(ValueError, match=problem):
        Q.quantize_symmetric_rows(x, 8, dtype)
    out, status = jax.jit(lambda a: Q.quantize_symmetric_rows_with_status(a, 8, dtype))(x)
    assert int(status[0]) != 0 and int(status[1]) == 0
    assert not np.asarray(out.codes[0]).any()


@pytest.mark.parametrize("x,match", [
    (np.array([[1.0, np.nan]], np.float32), "non-finite"),
    (np.array([[1.0, np.inf]], np.float32), "non-finite"),
    (np.array([[-np.inf, 1.0]], np.float32), "non-finite"),
    (np.ones((3,), np.float32), "2-D"),
    (np.ones((2, 3, 4), np.float32), "2-D"),
    (np.ones((0, 4), np.float32), "empty"),
    (np.ones((4, 0), np.float32), "empty"),
    (np.ones((2, 2), np.int32), "floating"),
])
def test_rows_bad_inputs(x, match):
    with pytest.raises(ValueError, match=match):
        Q.quantize_symmetric_rows(x)


@pytest.mark.parametrize("bits", [1, 9, 0, 16, 8.0, True, "8"])
def test_rows_bad_bits(bits):
    with pytest.raises(ValueError, match="bits"):
        Q.quantize_symmetric_rows(np.ones((2, 2), np.float32), bits)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.int8, "fp8", jnp.float8_e4m3fn])
def test_rows_bad_qparam_dtype(dtype):
    with pytest.raises(ValueError, match="qparam_dtype"):
        Q.quantize_symmetric_rows(np.ones((2, 2), np.float32), 8, dtype)


def test_nonfinite_status_under_jit():
    x = np.array([[1.0, np.nan], [1.0, 2.0], [np.inf, 0.0]], np.float32)
    _, status = jax.jit(lambda a: Q.quantize_symmetric_rows_with_status(a, 8))(x)
    assert list(np.asarray(status)) == [Q.QuantStatus.NONFINITE_INPUT, 0, Q.QuantStatus.NONFINITE_INPUT]
    assert Q.describe_status(status) == ["NONFINITE_INPUT"]


def test_public_function_traces_without_value_checks():
    """Under jit the public function cannot raise on values; it returns the status form's values."""
    x = np.array([[1e-3, 0.0], [1.0, 2.0]], np.float32)
    out = jax.jit(lambda a: Q.quantize_symmetric_rows(a, 8, jnp.float16))(x)
    ref, _ = Q.quantize_symmetric_rows_with_status(x, 8, jnp.float16)
    np.testing.assert_array_equal(np.asarray(out.codes), np.asarray(ref.codes))
    with pytest.raises(ValueError, match="2-D"):      # static checks still raise while tracing
        jax.jit(lambda a: Q.quantize_symmetric_rows(a))(np.ones((2, 2, 2), np.float32))


def test_fp16_and_bf16_inputs():
    x = random_tensor(3, (4, 8)).astype(np.float16)
    got = Q.quantize_symmetric_rows(jnp.asarray(x), 8, jnp.float16)
    for m in range(4):
        c, s = symmetric_row(x[m], 8, np.float16)
        assert float(got.scale[m]) == float(s)
        check_codes(got.codes[m], c, x[m].astype(np.float64) / float(s))
    xb = jnp.asarray(random_tensor(4, (4, 8)), jnp.bfloat16)
    got = Q.quantize_symmetric_rows(xb, 8)
    np.testing.assert_allclose(np.asarray(Q.dequantize_symmetric_rows(got.codes, got.scale)),
                               np.asarray(xb, np.float64), atol=float(np.max(got.scale)) / 2 * 1.0001)


GROUP_CASES = [((4, 12), 1, 0), ((4, 12), -1, 4), ((2, 3, 8), 1, 0), ((2, 3, 8), 2, 2), ((2, 6, 4), 1, 3),
               ((24,), 0, 6)]


@given(seed=st.integers(0, 2**32 - 1), case=st.sampled_from(GROUP_CASES), bits=st.sampled_from([3, 8]),
       dtype=st.sampled_from(QDTYPES[:2]))
@settings(max_examples=30)
def test_grouped_match_oracle(seed, case, bits, dtype):
    shape, axis, g = case
    x = random_tensor(seed, shape, 0.0, 2.0, zero_fraction=0.2)
    try:
        want_codes, want_scale = symmetric_groups(x, bits, axis % len(shape), g, dtype)
    except OracleReject:                         # a small group of tiny values: FTZ-unsafe fp16 scale
        with pytest.raises(ValueError, match="scale"):
            Q.quantize_symmetric(x, bits, axis=axis, group_size=g, qparam_dtype=dtype)
        return
    got = Q.quantize_symmetric(x, bits, axis=axis, group_size=g, qparam_dtype=dtype)
    assert got.scale.shape == want_scale.shape and got.scale.dtype == dtype
    assert (bits_of(got.scale) == bits_of(want_scale)).all()
    n = shape[axis]
    s = np.repeat(want_scale.astype(np.float64), g or n, axis=axis)
    check_codes(got.codes, want_codes, x / s)
    back = Q.dequantize_symmetric(got.codes, got.scale, axis=axis, group_size=g)
    assert (np.abs(np.asarray(back, np.float64) - x) <= s / 2 * (1 + 1e-5)).all()


def test_grouped_valid_length_masks_padding():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 10)).astype(np.float32)
    vl = np.array([10, 6, 0], np.int32)
    x_garbage = x.copy()
    x_garbage[1, 6:] = 1e6                              # beyond valid_length: must not influence anything
    got = Q.quantize_symmetric(x_garbage, 8, axis=1, group_size=4, valid_length=vl)
    want_codes, want_scale = symmetric_groups(x, 8, 1, 4, np.float32, valid_length=vl)
    assert got.scale.shape == (3, 3)
    np.testing.assert_array_equal(np.asarray(got.scale), want_scale)
    assert not np.asarray(got.codes[1, 6:]).any() and not np.asarray(got.codes[2]).any()
    check_codes(got.codes, want_codes, x / np.repeat(want_scale, 4, axis=1)[:, :10])


def test_grouped_partial_group_rejected_without_valid_length():
    with pytest.raises(ValueError, match="partial"):
        Q.quantize_symmetric(np.ones((2, 10), np.float32), 8, group_size=4)
    with pytest.raises(ValueError, match="axis"):
        Q.quantize_symmetric(np.ones((2, 8), np.float32), 8, axis=2)
