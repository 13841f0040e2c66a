"""The transposed-V per-token INT layout (int8_vt / int4_vt): bytes against an independent NumPy packing oracle,
values against the layout-1 per-token scheme (same quantizer), decode through the fused Mosaic GPU entry point
(its plain-JAX partials on CPU) against the float64 oracle, dispatch routing and bad input."""
from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.abi.reference import decode_attention_reference
from kvquant_jax.abi.regions import dense_operand, region
from kvquant_jax.attention import dispatch
from kvquant_jax.cache.per_token_vt import TransposedVPerTokenScheme
from kvquant_jax.cache.registry import make_scheme
from kvquant_jax.quant.packing import unpack_bits

from cache_helpers import ragged_twins

B, H, D, C = 3, 2, 16, 32


def _appends(bits, seed=0):
    """Ragged multi-row and one-row appends (odd lengths, so INT4 V bytes are shared across appends) into the
    transposed-V scheme and the layout-1 per-token scheme; returns both final states and lengths."""
    vt = TransposedVPerTokenScheme(bits=bits)
    ref = make_scheme(f"int{bits}")
    (s_vt, s_ref), lengths = ragged_twins((vt, ref), B, H, D, C, seed)
    return vt, ref, s_vt, s_ref, lengths


def _np_signed_pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Independent packing oracle: signed codes [..., n] -> two's-complement bytes, element 2i in the low nibble."""
    u = (q.astype(np.int64) & ((1 << bits) - 1)).astype(np.uint8)
    if bits == 8:
        return u
    return (u[..., 0::2] | (u[..., 1::2] << 4)).astype(np.uint8)


@pytest.mark.parametrize("bits", [8, 4])
def test_bytes_match_the_numpy_layout_oracle(bits):
    _, _, s_vt, s_ref, lengths = _appends(bits)
    half = 2 ** (bits - 1)
    q = np.asarray(unpack_bits(s_ref.k_codes, bits, axis=-1, count=D)).astype(np.int64) - half     # [B,H,C,D]
    qv = np.asarray(unpack_bits(s_ref.v_codes, bits, axis=-1, count=D)).astype(np.int64) - half
    live = np.arange(C)[None, :] < np.asarray(lengths)[:, None]                                    # [B, C]
    q = np.where(live[:, None, :, None], q, 0)                  # never-written slots hold code 0 (byte 0)
    qv = np.where(live[:, None, :, None], qv, 0)
    np.testing.assert_array_equal(np.asarray(s_vt.k_codes)[live[:, None, :].repeat(H, 1)],
                                  _np_signed_pack(q, bits)[live[:, None, :].repeat(H, 1)])
    np.testing.assert_array_equal(np.asarray(s_vt.v_codes), _np_signed_pack(np.swapaxes(qv, 2, 3), bits))
    np.testing.assert_array_equal(np.asarray(s_vt.k_scale), np.asarray(s_ref.k_scale))


@pytest.mark.parametrize("bits", [8, 4])
def test_values_equal_the_layout_1_scheme(bits):
    vt, ref, s_vt, s_ref, lengths = _appends(bits, seed=1)
    a, b = vt.materialize_layer(s_vt, lengths), ref.materialize_layer(s_ref, lengths)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    vt.validate_layer(s_vt, lengths)
    assert vt.layer_nbytes(s_vt) == ref.layer_nbytes(s_ref)


@pytest.mark.parametrize("bits", [8, 4])
def test_fused_decode_matches_the_float64_oracle(bits):
    vt, _, s_vt, _, lengths = _appends(bits, seed=2)
    rng = np.random.default_rng(3)
    g = 3
    q = jnp.asarray(rng.normal(0, 1, (B, H * g, D)), jnp.float32)
    k_new = jnp.asarray(rng.normal(0, 1, (B, H, D)), jnp.float32)
    v_new = jnp.asarray(rng.normal(0, 1, (B, H, D)), jnp.float32)
    out = dispatch.decode_attention(q, vt, s_vt, lengths, k_new, v_new, impl="kernel")
    k, v, _ = vt.materialize_layer(s_vt, lengths)
    want = decode_attention_reference(np.asarray(q), [region(dense_operand(k), dense_operand(v), lengths)],
                                      k_new=np.asarray(k_new), v_new=np.asarray(v_new))
    err = np.abs(np.asarray(out, np.float64) - want).max() / np.abs(want).max()
    assert err < 1e-5, err


def test_dispatch_auto_on_cpu_serves_the_reference_and_says_why(caplog):
    vt, _, s_vt, _, lengths = _appends(4, seed=4)
    q = jnp.ones((B, H * 2, D), jnp.float32)
    dispatch.SERVED.clear()
    with caplog.at_level(logging.INFO, logger="kvquant_jax.attention"):
        out = dispatch.decode_attention(q, vt, s_vt, lengths, impl="auto")
    assert out.shape == q.shape and np.isfinite(np.asarray(out)).all()
    (key,) = [k for k in dispatch.SERVED if "TransposedVFormat" in k[1]]
    assert key[0] == "reference" and "no native TransposedVFormat kernel on cpu" in dispatch.SERVED[key]
    assert any("reference served" in r.getMessage() for r in caplog.records)


def test_schema_differs_from_layout_1_and_names_the_layout():
    a, b = make_scheme("int4_vt").schema, make_scheme("int4:group_size=0").schema
    assert a != b and a.scheme == "per_token_vt" and dict(a.extra)["physical_layout"]
    assert a.kernel_family == "mosaic_gpu_swap_ab"


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        TransposedVPerTokenScheme(bits=2)
    with pytest.raises(ValueError, match="capacity 33 must be multiples of 2"):
        TransposedVPerTokenScheme(bits=4).init_layer(1, 33, 1, 16)
    vt = TransposedVPerTokenScheme(bits=4)
    st = vt.init_layer(1, 8, 1, 4)
    k = np.ones((1, 2, 1, 4), np.float32)
    k[0, 1, 0, 2] = np.nan
    _, ok = vt.append_layer_with_status(st, jnp.zeros((1,), jnp.int32), k, k, jnp.array([2], jnp.int32))
    assert not bool(ok[0])


def test_one_row_append_keeps_the_shared_byte_of_the_old_row():
    """INT4 V: position 2j+1 shares a byte with 2j; appending it must leave the older token's code intact."""
    vt = TransposedVPerTokenScheme(bits=4)
    st = vt.init_layer(1, 4, 1, 2)
    x0 = jnp.asarray([[[[1.0, -1.0]]]])
    x1 = jnp.asarray([[[[-0.5, 1.0]]]])
    st = vt.append_layer(st, jnp.array([0], jnp.int32), x0, x0, jnp.array([1], jnp.int32))
    before = np.asarray(vt.materialize_layer(st, jnp.array([1], jnp.int32))[1])[0, 0, 0]
    st = vt.append_layer(st, jnp.array([1], jnp.int32), x1, x1, jnp.array([1], jnp.int32))
    after = np.asarray(vt.materialize_layer(st, jnp.array([2], jnp.int32))[1])[0, 0]
    np.testing.assert_array_equal(after[0], before)
    np.testing.assert_allclose(after[1], [-4 / 7, 1.0], rtol=1e-3)
