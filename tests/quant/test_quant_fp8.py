"""FP8 E4M3 / E5M2 with external scales: saturating cast, scale metadata, warmup scales (0x0A)."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvquant_jax.quant as Q
from quant_oracles import random_tensor

NP_FP8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def oracle_fp8(x, scale, fmt):
    """float64 divide, clip to +-max, round to the FP8 format (ml_dtypes: round to nearest even)."""
    q = np.clip(x.astype(np.float64) / scale, -MAX[fmt], MAX[fmt])
    return q.astype(NP_FP8[fmt])


@given(seed=st.integers(0, 2**32 - 1), fmt=st.sampled_from(["e4m3", "e5m2"]), per_head=st.booleans(),
       log_scale=st.floats(-3, 2))
@settings(max_examples=30)
def test_fp8_matches_oracle_and_saturates(seed, fmt, per_head, log_scale):
    x = random_tensor(seed, (2, 4, 3, 8), -1.0, 3.0)                   # [B, H, T, D], includes saturating values
    rng = np.random.default_rng(seed)
    value = (10.0 ** (log_scale + rng.uniform(0, 0.5, size=(4,) if per_head else ()))).astype(np.float32)
    scale = Q.Fp8Scale(jnp.asarray(value), "calibrated")
    head_axis = 1 if per_head else None
    codes = Q.quantize_fp8(x, scale, fmt, head_axis=head_axis)
    assert codes.dtype == Q.fp8_dtype(fmt)
    s = value.reshape(1, 4, 1, 1) if per_head else value
    want = oracle_fp8(x, s.astype(np.float64), fmt)
    np.testing.assert_array_equal(np.asarray(codes).view(np.uint8), want.view(np.uint8))
    c = np.asarray(codes).astype(np.float64)
    assert np.isfinite(c).all() and np.abs(c).max() <= MAX[fmt]
    back = np.asarray(Q.dequantize_fp8(codes, scale, head_axis=head_axis), np.float64)
    q = x / s
    normal = (np.abs(q) >= float(jnp.finfo(Q.fp8_dtype(fmt)).tiny)) & (np.abs(q) <= MAX[fmt])
    rel = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}[fmt]                       # half an ulp relative (3 / 2 mantissa bits)
    assert (np.abs(back - x) <= rel * np.abs(x) * (1 + 1e-6))[normal].all()
    sat = np.abs(q) > MAX[fmt]
    np.testing.assert_array_equal(np.abs(c[sat]), MAX[fmt])


def test_infinite_values_saturate_under_jit():
    x = jnp.array([jnp.inf, -jnp.inf, 1e9, 1.0], jnp.float32)
    for fmt in ("e4m3", "e5m2"):
        codes = jax.jit(lambda a: Q.quantize_fp8(a, Q.uncalibrated_fp8_scale(), fmt))(x)
        np.testing.assert_array_equal(np.asarray(codes, np.float64), [MAX[fmt], -MAX[fmt], MAX[fmt], 1.0])
    with pytest.raises(ValueError, match="non-finite"):
        Q.quantize_fp8(x, Q.uncalibrated_fp8_scale())


def test_scale_metadata():
    unc = Q.uncalibrated_fp8_scale()
    assert unc.source == "uncalibrated" and not unc.calibrated and float(unc.value) == 1.0
    assert Q.uncalibrated_fp8_scale(num_heads=3).value.shape == (3,)
    x = np.array([[[1.0, -900.0]], [[0.0, 0.0]], [[2.0, 3.0]]], np.float32)       # [H=3, 1, 2]
    amax = Q.observe_absmax(x, head_axis=0)
    np.testing.assert_array_equal(np.asarray(amax), [900.0, 0.0, 3.0])
    sc = Q.fp8_scale_from_absmax(amax, "e4m3")
    assert sc.source == "warmup" and sc.calibrated
    np.testing.assert_array_equal(np.asarray(sc.value), np.float32([900.0 / 448.0, 1.0, 3.0 / 448.0]))
    assert float(Q.fp8_scale_from_absmax(57344.0, "e5m2", source="calibrated").value) == 1.0
    codes = Q.quantize_fp8(x, sc, head_axis=0)
    assert float(np.asarray(codes, np.float64).max()) == 448.0 and float(np.asarray(codes, np.float64).min()) == -448.0
    # Fp8Scale is a pytree: it crosses jit with its source kept as static metadata
    out = jax.jit(lambda s: s)(sc)
    assert isinstance(out, Q.Fp8Scale) and out.source == "warmup"
    with pytest.raises(ValueError, match="source"):
        Q.Fp8Scale(jnp.float32(1.0), "guessed")
    with pytest.raises(ValueError, match="source"):
        Q.fp8_scale_from_absmax(1.0, source="uncalibrated")


@pytest.mark.parametrize("call,match", [
    (lambda: Q.quantize_fp8(np.ones(3, np.float32), 1.0, "e3m4"), "format"),
    (lambda: Q.quantize_fp8(np.ones((2, 3), np.float32), jnp.ones(2)), "head_axis"),
    (lambda: Q.quantize_fp8(np.ones((2, 3), np.float32), 0.0), "scale"),
    (lambda: Q.quantize_fp8(np.ones((2, 3), np.float32), -1.0), "scale"),
    (lambda: Q.quantize_fp8(np.ones((2, 3), np.float32), 1e-40), "scale"),
    (lambda: Q.quantize_fp8(np.array([np.nan], np.float32), 1.0), "non-finite"),
    (lambda: Q.quantize_fp8(np.ones((0,), np.float32), 1.0), "empty"),
    (lambda: Q.fp8_scale_from_absmax(np.float32(np.inf)), "finite"),
    (lambda: Q.fp8_scale_from_absmax(np.float32(-1.0)), "non-negative"),
])
def test_fp8_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()
