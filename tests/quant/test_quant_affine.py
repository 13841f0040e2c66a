"""Affine group quantization (any axis, any group size, two zero conventions) vs the float64 oracle."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvquant_jax.quant as Q
from quant_oracles import (OracleReject, affine_decode, affine_encode, affine_qparams, near_half, random_tensor,
                           ulp_distance)

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)

# (shape, axis, group_size): per-tensor, per-token, per-token-group, per-channel, per-channel over G tokens,
# per-head (a [B, H, T*D] view) and a 1-element group
LAYOUTS = [((24,), 0, 0), ((2, 3, 8, 8), 3, 0), ((2, 3, 8, 8), 3, 4), ((2, 3, 8, 8), 2, 0), ((2, 3, 8, 8), 2, 4),
           ((2, 3, 64), 2, 0), ((3, 5), 1, 1)]


def oracle_affine(x, bits, axis, g, dtype, zero, valid_length=None):
    """Per-group loop: qparams (or OracleReject), for every group a list of (index tuple, valid values)."""
    xm = np.moveaxis(x.astype(np.float64), axis, -1)
    n = xm.shape[-1]
    g = g or n
    groups = []
    for idx in np.ndindex(*xm.shape[:-1]):
        vl = n if valid_length is None else int(np.broadcast_to(valid_length, xm.shape[:-1])[idx])
        for j in range(-(-n // g)):
            lo, hi = j * g, min((j + 1) * g, n, vl)
            vals = xm[idx][lo:max(lo, hi)]
            qp = affine_qparams(vals, bits, dtype, zero) if vals.size else None
            groups.append((idx, j, lo, vals, qp))
    return groups


def check_affine(x, got, bits, axis, g, dtype, zero, valid_length=None):
    q = 2 ** bits - 1
    codes = np.moveaxis(np.asarray(got.codes, np.int64), axis, -1)
    scale = np.moveaxis(np.asarray(got.scale), axis, -1)
    zom = np.moveaxis(np.asarray(got.zero_or_min), axis, -1)
    decoded = np.moveaxis(np.asarray(Q.dequantize_affine(got.codes, got.scale, got.zero_or_min, axis=axis,
                                                         group_size=g, zero=zero), np.float64), axis, -1)
    for idx, j, lo, vals, qp in oracle_affine(x, bits, axis, g, dtype, zero, valid_length):
        s, z = scale[idx + (j,)], zom[idx + (j,)]
        c = codes[idx][lo:lo + vals.size]
        if qp is None:                                   # a fully masked group: constant-at-0 sentinel
            assert float(s) == 1.0 and float(z) == 0.0
            continue
        # qparams: float32 derivation is within one unit of the qparam dtype of the float64 reference
        assert ulp_distance(s, qp[0], dtype) <= 1, (s, qp[0])
        if zero == "min":
            assert s.dtype == dtype and z.dtype == dtype and float(z) == float(qp[1])
        else:
            assert z.dtype == np.uint8 and abs(int(z) - int(qp[1])) <= 1
        want, quot = affine_encode(vals, bits, s, z, zero)      # oracle codes from the STORED qparams
        slack = 4e-7 * (1 + (np.abs(vals) + abs(float(z))) / float(s))
        bad = (c != want) & ~(near_half(quot, slack) & (np.abs(c - want) == 1))
        assert not bad.any(), (c[bad], want[bad])
        assert c.min() >= 0 and c.max() <= q
        dec = decoded[idx][lo:lo + vals.size]
        # float32 decode: a few roundings of terms of size |u * s| and |min|
        fp32_err = 4e-7 * (np.abs(c * float(s)) + abs(float(z)) * (float(s) if zero == "int" else 1.0))
        assert (np.abs(dec - affine_decode(c, s, z, zero)) <= fp32_err + 1e-30).all()
        if float(s) == 1.0 and vals.max() == vals.min():
            continue
        lo_r = float(z) if zero == "min" else -float(z) * float(s)
        inside = (vals >= lo_r) & (vals <= lo_r + q * float(s))
        tol = float(s) / 2 + 1e-6 * (np.abs(vals) + abs(lo_r))
        assert (np.abs(dec - vals) <= tol)[inside].all()


@given(seed=st.integers(0, 2**32 - 1), layout=st.sampled_from(LAYOUTS), bits=st.integers(1, 8),
       dtype=st.sampled_from([F16, F32]), zero=st.sampled_from(["min", "int"]))
@settings(max_examples=40)
def test_affine_matches_oracle(seed, layout, bits, dtype, zero):
    shape, axis, g = layout
    x = random_tensor(seed, shape, 0.0, 2.0, zero_fraction=0.1, axis=axis)
    try:
        oracle_affine(x, bits, axis, g, dtype, zero)
    except OracleReject:
        with pytest.raises(ValueError):
            Q.quantize_affine(x, bits, axis, g, dtype, zero)
        return
    got = Q.quantize_affine(x, bits, axis, g, dtype, zero)
    n = shape[axis]
    want_shape = shape[:axis] + (n // (g or n),) + shape[axis + 1:]
    assert got.codes.shape == shape and got.codes.dtype == jnp.uint8 and got.scale.shape == want_shape
    check_affine(x, got, bits, axis, g, dtype, zero)


def test_layout_qparams_broadcast_to_intended_dims():
    """Explicit per-channel-over-G-tokens (KIVI K) and per-token-group (KIVI V) qparams from numpy reductions."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 2, 8, 6)).astype(np.float32)            # [B, H, T, D]
    k = Q.quantize_affine(x, 2, axis=2, group_size=4, qparam_dtype=jnp.float32)
    tiles = x.reshape(2, 2, 2, 4, 6)                                     # [B, H, T/G, G, D]
    np.testing.assert_array_equal(np.asarray(k.zero_or_min), tiles.min(axis=3))
    np.testing.assert_allclose(np.asarray(k.scale), (tiles.max(axis=3) - tiles.min(axis=3)) / 3, rtol=2e-7)
    v = Q.quantize_affine(x, 4, axis=3, group_size=3, qparam_dtype=jnp.float32)
    tiles = x.reshape(2, 2, 8, 2, 3)
    np.testing.assert_array_equal(np.asarray(v.zero_or_min), tiles.min(axis=4))
    np.testing.assert_allclose(np.asarray(v.scale), (tiles.max(axis=4) - tiles.min(axis=4)) / 15, rtol=2e-7)
    # per-head: a group spanning [T, D] of one head
    h = Q.quantize_affine(x.reshape(2, 2, 48), 8, axis=2, qparam_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(h.zero_or_min)[..., 0], x.min(axis=(2, 3)))


def test_endpoints_hit_exactly():
    x = np.array([[-3.0, 5.0, 1.0, 0.25], [2.0, 4.0, 3.0, 2.5]], np.float32)
    for bits in (2, 4, 8):
        q = 2 ** bits - 1
        got = Q.quantize_affine(x, bits, qparam_dtype=jnp.float32)
        c = np.asarray(got.codes)
        assert (c[:, [0, 0]] == [[0, 0], [0, 0]]).all() and c[0, 1] == q and c[1, 1] == q
        back = np.asarray(Q.dequantize_affine(*got))
        np.testing.assert_allclose(back[:, :2], x[:, :2], rtol=1e-6)
        gi = Q.quantize_affine(x, bits, qparam_dtype=jnp.float32, zero="int")
        back = np.asarray(Q.dequantize_affine(*gi, zero="int"))
        s = np.asarray(gi.scale, np.float64)
        assert int(gi.zero_or_min[1, 0]) == 0                      # positive row: range widened to include 0
        assert (np.abs(back - x) <= s / 2 * (1 + 1e-6)).all()


def test_int_zero_point_represents_zero_exactly():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 16)).astype(np.float32)
    x[:, ::3] = 0.0
    for bits in (3, 8):
        got = Q.quantize_affine(x, bits, qparam_dtype=jnp.float16, zero="int")
        z = np.asarray(got.zero_or_min)
        assert z.dtype == np.uint8 and (z <= 2 ** bits - 1).all()
        back = np.asarray(Q.dequantize_affine(*got, zero="int"))
        assert (back[:, ::3] == 0).all()


def test_clipping_when_stored_min_rounds_up():
    """fp16 rounding moves the stored min above the true min: the element below is clipped to code 0."""
    x = np.array([[1000.3, 1000.8, 1001.0]], np.float32)
    got = Q.quantize_affine(x, 8, qparam_dtype=jnp.float16)
    assert float(got.zero_or_min[0, 0]) == 1000.5                 # fp16 spacing at 1000 is 0.5
    assert int(got.codes[0, 0]) == 0
    want, _ = affine_encode(x[0].astype(np.float64), 8, got.scale[0, 0], got.zero_or_min[0, 0], "min")
    np.testing.assert_array_equal(np.asarray(got.codes[0]), want)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
def test_zero_min_is_stored_as_positive_zero(dtype):
    """A zero min has one canonical encoding (+0): mixed -0/+0 groups and a negative min underflowing fp16."""
    x = np.array([[-0.0, 0.0, 1.0, 0.5], [0.0, -0.0, 1.0, 0.5], [-0.0, -0.0, -0.0, -0.0],
                  [-2.6e-8, 0.5, 1.0, 0.25]], np.float32)
    got = Q.quantize_affine(x, 2, qparam_dtype=dtype)
    mins = np.asarray(got.zero_or_min)[:, 0]
    n = 3 if dtype == jnp.float32 else 4                          # in fp32 -2.6e-8 is a genuine negative min
    assert (mins[:n] == 0).all() and not np.signbit(mins[:n]).any(), mins


@pytest.mark.parametrize("zero", ["min", "int"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
def test_constant_groups_sentinel_and_exact_reconstruction(zero, dtype):
    x = np.array([[0.0, 0.0, 0.0, 0.0], [2.5, 2.5, 2.5, 2.5], [-0.125, -0.125, -0.125, -0.125]], np.float32)
    got = Q.quantize_affine(x, 4, qparam_dtype=dtype, zero=zero)
    back = np.asarray(Q.dequantize_affine(*got, zero=zero))
    if zero == "min":
        np.testing.assert_array_equal(np.asarray(got.scale, np.float64), [[1], [1], [1]])
        assert not np.asarray(got.codes).any()
        np.testing.assert_array_equal(back, x)                    # representable constants decode exactly
    else:
        # only the all-zero group is constant once the range is widened to contain 0; it decodes exactly,
        # a non-zero constant c is an ordinary group [min(c, 0), max(c, 0)] with the usual s/2 bound
        assert float(got.scale[0, 0]) == 1.0 and int(got.zero_or_min[0, 0]) == 0
        assert (back[0] == 0).all()
        s = np.asarray(got.scale, np.float64)
        assert (np.abs(back - x) <= s / 2).all()


def test_valid_length_masks_partial_trailing_group():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 2, 11)).astype(np.float32)        # 11 tokens, G = 4 -> 3 groups, last partial
    vl = np.array([[11], [7], [0]], np.int32)[:, :, None][:, 0]   # per batch row, broadcast over the other axis
    garbage = x.copy()
    garbage[1, :, 7:] = -1e4
    got = Q.quantize_affine(garbage, 4, axis=2, group_size=4, qparam_dtype=jnp.float32, valid_length=vl)
    assert got.scale.shape == (3, 2, 3)
    codes = np.asarray(got.codes)
    assert not codes[1, :, 7:].any() and not codes[2].any()
    check_affine(x, got, 4, 2, 4, F32, "min", valid_length=vl)
    with pytest.raises(ValueError, match="partial"):
        Q.quantize_affine(x, 4, axis=2, group_size=4)


def test_mask_excludes_elements_from_qparams():
    x = np.array([[1.0, 2.0, 100.0, 3.0]], np.float32)
    got = Q.quantize_affine(x, 2, qparam_dtype=jnp.float32, mask=np.array([[True, True, False, True]]))
    assert float(got.scale[0, 0]) == pytest.approx(2.0 / 3) and float(got.zero_or_min[0, 0]) == 1.0
    assert int(got.codes[0, 2]) == 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(x=np.array([[1.0, np.nan]], np.float32)), "non-finite"),
    (dict(x=np.array([[np.inf, 1.0]], np.float32)), "non-finite"),
    (dict(x=np.ones((0, 3), np.float32)), "empty"),
    (dict(x=np.float32(1.0)), "rank"),
    (dict(x=np.ones((2, 4), np.float32), bits=0), "bits"),
    (dict(x=np.ones((2, 4), np.float32), bits=9), "bits"),
    (dict(x=np.ones((2, 4), np.float32), zero="float"), "zero"),
    (dict(x=np.ones((2, 4), np.float32), qparam_dtype=jnp.int8), "qparam_dtype"),
    (dict(x=np.ones((2, 4), np.float32), group_size=-1), "group_size"),
    (dict(x=np.array([[0.0, 1e-6]], np.float32)), "subnormal|underflow"),     # fp16 scale 6.7e-8: not normal
    (dict(x=np.array([[-3e38, 3e38]], np.float32), qparam_dtype=jnp.float32), "overflow"),   # width overflows
    (dict(x=np.array([[-1e7, 1e7]], np.float32)), "overflow"),                  # fp16 scale/min overflow
])
def test_affine_bad_inputs(kwargs, match):
    kwargs = dict(dict(bits=8), **kwargs)
    with pytest.raises(ValueError, match=match):
        Q.quantize_affine(**kwargs)


def test_status_under_jit():
    x = np.array([[1.0, np.nan], [1.0, 2.0], [0.0, 1e-6]], np.float32)
    out, status = jax.jit(lambda a: Q.quantize_affine_with_status(a, 4))(x)
    st_ = np.asarray(status)[:, 0]
    assert st_[0] == Q.QuantStatus.NONFINITE_INPUT and st_[1] == 0 and st_[2] != 0
    assert not np.asarray(out.codes)[[0, 2]].any()
