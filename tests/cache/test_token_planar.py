"""The token-planar per-token INT layout (int2_planar / int4_planar): bytes against an independent NumPy reading of
the documented layout, values against the layout-1 per-token scheme (same quantizer), decode through the fused
Mosaic GPU entry point (its plain-JAX partials on CPU) against the float64 oracle, dispatch routing and bad
input."""
from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.abi import token_planar as tp
from kvquant_jax.abi.reference import decode_attention_reference
from kvquant_jax.abi.regions import dense_operand, region
from kvquant_jax.attention import dispatch
from kvquant_jax.cache.per_token import PerTokenScheme
from kvquant_jax.cache.registry import make_scheme
from kvquant_jax.cache.token_planar import TokenPlanarScheme
from pallas_kernels import decode_attention_mgpu_planar as mp

from cache_helpers import ragged_twins, unpack, unpack_planar

B, H, D = 3, 2, 16


def _twins(bits, seed=0, plane_rows=2, capacity=32):
    """The ragged appends (one-row appends, odd lengths: bytes shared by tokens of different appends) into the
    token-planar scheme and the layout-1 per-token scheme (group 0)."""
    planar = TokenPlanarScheme(bits=bits, plane_rows=plane_rows)
    ref = PerTokenScheme(bits=bits, group_size=0)
    (s_p, s_ref), lengths = ragged_twins((planar, ref), B, H, D, capacity, seed)
    return planar, ref, s_p, s_ref, lengths


@pytest.mark.parametrize("bits", [2, 4])
def test_bytes_match_the_documented_layout(bits):
    planar, _, s_p, s_ref, lengths = _twins(bits)
    c = 32
    live = np.arange(c)[None, :] < np.asarray(lengths)[:, None]                            # [B, C]
    for b in range(B):
        want = unpack(np.asarray(s_ref.k_codes)[b], bits, D)                               # [H, C, D] u
        got = unpack_planar(np.asarray(s_p.k_codes)[b], bits, planar.plane_rows)
        np.testing.assert_array_equal(got[:, live[b]], want[:, live[b]])
        want_v = unpack(np.asarray(s_ref.v_codes)[b], bits, D)
        got_v = unpack_planar(np.swapaxes(np.asarray(s_p.v_codes)[b], 1, 2), bits, planar.plane_rows)
        np.testing.assert_array_equal(got_v[:, live[b]], want_v[:, live[b]])
        for f in ("k_scale", "v_scale"):
            np.testing.assert_array_equal(np.asarray(getattr(s_p, f))[b][:, live[b]],
                                          np.asarray(getattr(s_ref, f))[b][:, live[b], 0])
    assert s_p.k_codes.shape == (B, H, c * bits // 8, D) and s_p.v_codes.shape == (B, H, D, c * bits // 8)


@pytest.mark.parametrize("bits", [2, 4])
def test_values_equal_the_layout_1_scheme(bits):
    planar, ref, s_p, s_ref, lengths = _twins(bits, seed=1)
    a, b = planar.materialize_layer(s_p, lengths), ref.materialize_layer(s_ref, lengths)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    planar.validate_layer(s_p, lengths)
    assert sum(planar.layer_nbytes(s_p).values()) == sum(ref.layer_nbytes(s_ref).values())


@pytest.mark.parametrize("bits", [2, 4])
def test_fused_decode_matches_the_float64_oracle(bits):
    """The dispatcher's fused entry (kernel algebra in plain JAX on CPU) over the stored layer in place, the
    current token in the same softmax, 64-row planes (the kernel's) and ragged lengths."""
    d = 64                                                  # the kernel reads 64-wide chunks of head_dim
    planar = TokenPlanarScheme(bits=bits)
    (s_p,), lengths = ragged_twins((planar,), B, H, d, 256, seed=2)
    rng = np.random.default_rng(3)
    g = 3
    q = jnp.asarray(rng.normal(0, 1, (B, H * g, d)), jnp.float32)
    k_new = jnp.asarray(rng.normal(0, 1, (B, H, d)), jnp.float32)
    v_new = jnp.asarray(rng.normal(0, 1, (B, H, d)), jnp.float32)
    out = dispatch.decode_attention(q, planar, s_p, lengths, k_new, v_new, impl="kernel", interpret=True)
    k, v, _ = planar.materialize_layer(s_p, lengths)
    want = decode_attention_reference(np.asarray(q), [region(dense_operand(k), dense_operand(v), lengths)],
                                      k_new=np.asarray(k_new), v_new=np.asarray(v_new))
    err = np.abs(np.asarray(out, np.float64) - want).max() / np.abs(want).max()
    assert err < 2e-6, err
    assert {k[0] for k in dispatch.SERVED if "TokenPlanarFormat" in k[1]} >= {"decode_attention_token_planar"}


@pytest.mark.parametrize("name", ["int2_planar", "qserve4_planar"])
def test_s8_entry_matches_the_float64_oracle(name):
    """The s8 tensor-core entry (its plain-JAX twin on CPU: query limbs, int32 plane dots, 21-bit ``p sv`` limbs)
    over the stored layer in place, the current token in the same softmax, ragged lengths."""
    from pallas_kernels import decode_attention_mgpu_planar_s8 as s8

    d, g = 64, 3
    scheme = make_scheme(name)
    (st,), lengths = ragged_twins((scheme,), B, H, d, 2 * scheme.block_t, seed=5)
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.normal(0, 1, (B, H * g, d)), jnp.float32)
    k_new = jnp.asarray(rng.normal(0, 1, (B, H, d)), jnp.float32)
    v_new = jnp.asarray(rng.normal(0, 1, (B, H, d)), jnp.float32)
    fmt, op = scheme.fused_decode_operand(st, lengths)
    assert s8.token_planar_s8_layout_unsupported(q, fmt, op) is None
    out = s8.decode_attention_token_planar_s8(q, fmt, op, lengths, k_new, v_new, interpret=True)
    k, v, _ = scheme.materialize_layer(st, lengths)
    want = decode_attention_reference(np.asarray(q), [region(dense_operand(k), dense_operand(v), lengths)],
                                      k_new=np.asarray(k_new), v_new=np.asarray(v_new))
    err = np.abs(np.asarray(out, np.float64) - want).max() / np.abs(want).max()
    assert out.dtype == jnp.float32 and err < 5e-5, err


def test_dispatch_auto_on_cpu_serves_the_reference_and_says_why(caplog):
    planar, _, s_p, _, lengths = _twins(2, seed=4)
    q = jnp.ones((B, H * 2, D), jnp.float32)
    dispatch.SERVED.clear()
    with caplog.at_level(logging.INFO, logger="kvquant_jax.attention"):
        out = dispatch.decode_attention(q, planar, s_p, lengths, impl="auto")
    assert out.shape == q.shape and np.isfinite(np.asarray(out)).all()
    (key,) = [k for k in dispatch.SERVED if "TokenPlanarFormat" in k[1]]
    assert key[0] == "reference" and "no native TokenPlanarFormat kernel on cpu" in dispatch.SERVED[key]


def test_kernel_layout_refusals_say_why():
    q = jnp.ones((B, H * 2, 128), jnp.float32)
    small = TokenPlanarScheme(bits=2, plane_rows=2)
    st = small.init_layer(B, 32, H, 128)
    fmt, op = small.fused_decode_operand(st, jnp.zeros((B,), jnp.int32))
    assert "plane_rows 2" in mp.token_planar_layout_unsupported(q, fmt, op)
    full = make_scheme("int2_planar")
    st = full.init_layer(B, 256, H, 96)
    fmt, op = full.fused_decode_operand(st, jnp.zeros((B,), jnp.int32))
    q96 = jnp.ones((B, H * 2, 96), jnp.float32)
    assert "head_dim 96" in mp.token_planar_layout_unsupported(q96, fmt, op)
    assert "Hopper" in mp.token_planar_layer_unsupported(q96, fmt, op)                 # this CPU
    with pytest.raises(NotImplementedError, match="head_dim 96"):
        mp.decode_attention_token_planar(q96, fmt, op, interpret=True)


def test_schema_differs_from_layout_1_and_names_the_layout():
    a, b = make_scheme("int2_planar").schema, make_scheme("int2:group_size=0").schema
    assert a != b and a.scheme == "token_planar" and dict(a.extra)["physical_layout"] == tp.LAYOUT_TAG
    assert make_scheme("int2_planar").schema != make_scheme("int2_planar:plane_rows=2").schema
    assert a.kernel_family == "mosaic_gpu_token_planar"
    assert make_scheme("int4_planar").bits == 4


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="bits must be 2 or 4"):
        TokenPlanarScheme(bits=8)
    with pytest.raises(ValueError, match="plane_rows must be an int >= 1"):
        TokenPlanarScheme(plane_rows=0)
    with pytest.raises(ValueError, match="capacity 300 must be a multiple of the 256-token block"):
        make_scheme("int2_planar").init_layer(1, 300, 1, 64)
    with pytest.raises(ValueError, match="bits must be 2 or 4"):
        tp.TokenPlanarFormat(bits=8)
    s = TokenPlanarScheme(bits=2, plane_rows=1)
    st = s.init_layer(1, 8, 1, 4)
    k = np.ones((1, 2, 1, 4), np.float32)
    k[0, 1, 0, 2] = np.nan
    _, ok = s.append_layer_with_status(st, jnp.zeros((1,), jnp.int32), k, k, jnp.array([2], jnp.int32))
    assert not bool(ok[0])


def test_one_row_appends_keep_the_other_planes_tokens():
    """Tokens of one block share bytes (one plane each): appending a token must leave every older token's code
    (the other planes' bits of the same byte) intact."""
    s = TokenPlanarScheme(bits=2, plane_rows=1)                # 4 tokens per byte: every append shares a byte
    st = s.init_layer(1, 8, 1, 2)
    rng = np.random.default_rng(5)
    seen = []
    for t in range(6):
        x = jnp.asarray(rng.normal(0, 1, (1, 1, 1, 2)).astype(np.float32))
        st = s.append_layer(st, jnp.array([t], jnp.int32), x, x, jnp.array([1], jnp.int32))
        k, v, _ = s.materialize_layer(st, jnp.array([t + 1], jnp.int32))
        seen.append(np.asarray(k)[0, 0, t])
        np.testing.assert_array_equal(np.asarray(k)[0, 0, :t + 1], np.stack(seen))
        np.testing.assert_array_equal(np.asarray(v)[0, 0, :t + 1], np.stack(seen))
