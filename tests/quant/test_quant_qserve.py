"""QServe per-(token, head) KV4 with a floating fp16 offset vs the design-notes reference (0x09C)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvquant_jax.quant as Q
from quant_oracles import OracleReject, near_half, qserve_encode, qserve_head, random_tensor, ulp_distance

F16 = np.dtype(jnp.float16)


@given(seed=st.integers(0, 2**32 - 1), shape=st.sampled_from([(2, 3, 2, 8), (1, 4, 16), (5, 32)]),
       shift=st.sampled_from([0.0, 3.0, -50.0]))
@settings(max_examples=30)
def test_qserve_matches_reference(seed, shape, shift):
    x = random_tensor(seed, shape, -1.0, 1.5) + np.float32(shift)    # shift: positive/negative-only ranges
    try:
        for idx in np.ndindex(*shape[:-1]):
            qserve_head(x[idx])
    except OracleReject:                                              # (vanishingly rare) narrow head
        with pytest.raises(ValueError):
            Q.quantize_qserve(x)
        return
    got = Q.quantize_qserve(x)
    assert got.codes.dtype == jnp.uint8 and got.scale.dtype == F16 and got.offset.dtype == F16
    assert got.scale.shape == shape[:-1] and got.offset.shape == shape[:-1]
    codes, scale, offset = (np.asarray(a) for a in got)
    decoded = np.asarray(Q.dequantize_qserve(*got), np.float64)
    for idx in np.ndindex(*shape[:-1]):
        a = x[idx].astype(np.float64)
        want_s, want_o = qserve_head(a)
        s, o = scale[idx], offset[idx]
        assert ulp_distance(s, want_s, F16) <= 1 and ulp_distance(o, want_o, F16) <= 1
        want_c, quot = qserve_encode(a, s, o)                  # codes from the STORED (re-read) qparams
        c = codes[idx].astype(np.int64)
        bad = (c != want_c) & ~(near_half(quot, 1e-6 * (1 + np.abs(quot))) & (np.abs(c - want_c) == 1))
        assert not bad.any()
        np.testing.assert_allclose(decoded[idx], (c - float(o)) * float(s), rtol=1e-6, atol=1e-6 * float(s))
        lo = -float(o) * float(s)                                # representable range of the stored qparams
        inside = (a >= lo) & (a <= lo + 15 * float(s))
        assert (np.abs(decoded[idx] - a) <= float(s) / 2 * (1 + 1e-3))[inside].all()


def test_positive_only_range_keeps_unclamped_offset():
    x = np.linspace(1.0, 2.0, 8, dtype=np.float32)[None]
    got = Q.quantize_qserve(x)
    assert float(got.offset[0]) == -15.0                        # -min / scale = -1 / (1/15): NOT clamped to 0
    np.testing.assert_array_equal(np.asarray(got.codes[0])[[0, -1]], [0, 15])
    back = np.asarray(Q.dequantize_qserve(*got))[0]
    assert abs(back[0] - 1.0) < 1e-3 and abs(back[-1] - 2.0) < 1e-3


def test_offset_uses_the_unrounded_scale():
    """Reference ABI: offset = fp16(-min / ideal_scale), not -min / fp16(scale).  Designed so the two differ."""
    ideal = 1.0 + 3 * 2.0**-12                          # fp16 rounds it up to 1 + 2**-10
    x = np.array([[-7.0, -7.0 + 15 * ideal, 0.0, 1.0]], np.float32)
    got = Q.quantize_qserve(x)
    assert float(got.scale[0]) == 1.0 + 2.0**-10
    want = np.float16(7.0 / ideal)
    assert want != np.float16(7.0 / float(got.scale[0]))
    assert np.asarray(got.offset)[0].view(np.uint16) == want.view(np.uint16)


def test_constant_and_narrow_heads_policy():
    x = np.array([[0.5, 0.5, 0.5, 0.5], [1.0, 1.0 + 2**-20, 1.0, 1.0], [0.0, 1.0, 2.0, 3.0]], np.float32)
    with pytest.raises(ValueError, match="constant"):
        Q.quantize_qserve(x[:1])
    with pytest.raises(ValueError, match="subnormal|underflow"):
        Q.quantize_qserve(x[1:2])
    _, status = jax.jit(lambda a: Q.quantize_qserve_with_status(a))(x)
    assert list(np.asarray(status) != 0) == [True, True, False]
    got = Q.quantize_qserve(x, degenerate="sentinel")
    np.testing.assert_array_equal(np.asarray(got.scale, np.float64), [1, 1, float(np.float16(0.2))])
    assert not np.asarray(got.codes[:2]).any()
    back = np.asarray(Q.dequantize_qserve(*got))
    np.testing.assert_array_equal(back[0], x[0])                # constant head: exact
    assert np.abs(back[1] - x[1]).max() <= 2**-20                 # narrow head: midpoint in fp16
    ref = Q.quantize_qserve(x[2:])
    np.testing.assert_array_equal(np.asarray(got.codes[2]), np.asarray(ref.codes[0]))


@pytest.mark.parametrize("x,kwargs,match", [
    (np.array([[1.0, np.nan]], np.float32), {}, "non-finite"),
    (np.array([[1.0, np.inf]], np.float32), dict(degenerate="sentinel"), "non-finite"),
    (np.ones((0, 4), np.float32), {}, "empty"),
    (np.ones((2, 4), np.float32), dict(degenerate="clamp"), "degenerate"),
    (np.array([[0.0, 1e6]], np.float32), {}, "overflow"),          # 1e6 / 15 > fp16 max
    (np.array([[1e5, 1e5 + 16]], np.float32), {}, "offset"),       # -min/scale = -9.4e4: fp16 offset overflows
])
def test_qserve_bad_inputs(x, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Q.quantize_qserve(x, **kwargs)
