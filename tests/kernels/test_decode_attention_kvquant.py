"""Pallas KVQuant decode attention (interpret mode on CPU) vs a float64 NumPy oracle: LUT decode, exact-hole sparse
replacement, RoPE of each cached key at its stored position inside the kernel, sink rows and the current token
under one softmax, GQA, ragged lengths, split-K."""
from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.cache import ops
from kvquant_jax.cache.interface import init_cache, layer_state
from kvquant_jax.cache.kvquant import KVQuantScheme, load_calibration
from pallas_kernels.decode_attention_kvquant import (channel_maps, decode_attention_kvquant,
                                                     decode_attention_kvquant_reference)

import kvquant_oracle as O

B, HKV, G, D, C = 2, 2, 3, 16, 32
THETA = 10000.0

kernel = jax.jit(decode_attention_kvquant, static_argnames=("fmt", "interpret", "block_t", "num_splits"))

# (scheme options, kernel options): each case is one compilation
CASES = {
    "nuq4_halfsplit_sink_sparse_splits": (dict(k_bits=4, v_bits=4, k_sparse_capacity=2, v_outliers=1, sink=1),
                                          dict(block_t=8, num_splits=2)),
    "nuq3k_nuq2v_interleaved_dense": (dict(k_bits=3, v_bits=2, rope_pairing="interleaved"),
                                      dict(block_t=16, num_splits=1)),
    "nuq2_post_rope_sparse": (dict(k_bits=2, v_bits=3, k_sparse_capacity=1, v_outliers=2, sink=1,
                                   key_stage="post_rope"), dict(block_t=32, num_splits=1)),
}


def make_scheme(**kw):
    return KVQuantScheme(rope_theta=THETA, calibration_id="kernel-test", **kw)


def calibrated(s, seed=0, k_edge=1.0):
    rng = np.random.default_rng(seed)

    def cb(bits, edge=1.0):
        c = np.sort(rng.uniform(-edge, edge, (1, 2 ** bits)), axis=1)
        c[:, 0], c[:, -1] = -edge, edge
        return c.astype(np.float32)

    cal = types.SimpleNamespace(schema=s.calibration_schema(), arrays={
        "k_scale": rng.uniform(0.3, 1.2, (1, HKV, D)).astype(np.float32),
        "k_zero": rng.uniform(-0.4, 0.4, (1, HKV, D)).astype(np.float32),
        "k_codebook": cb(s.k_bits, k_edge), "v_codebook": cb(s.v_bits)})
    cache = init_cache(s, num_layers=1, batch=B, capacity=C, num_kv_heads=HKV, head_dim=D)
    return load_calibration(cache, cal), cal.arrays


def filled(s, lengths, seed=0):
    """A one-layer cache with ``lengths`` rows of random post-RoPE keys (with planted outliers) and values."""
    rng = np.random.default_rng(seed)
    cache, arrays = calibrated(s, seed)
    t = int(max(lengths))
    k_pre = rng.normal(0, 0.7, (B, t, HKV, D))
    k_pre[:, ::3, :, 5] += 3.0
    k = O.rope64(k_pre, np.arange(t)[None, :, None], THETA, s.rope_pairing) if s.key_stage == "pre_rope" else k_pre
    v = rng.normal(0, 1, (B, t, HKV, D))
    v[:, :, 0, 9] *= 6
    cache = ops.append(cache, [(k.astype(np.float32), v.astype(np.float32))], np.asarray(lengths))
    return cache, arrays


def run_both(s, kopts, cache, seed=1, with_new=True):
    rng = np.random.default_rng(seed)
    sch, st = layer_state(cache, 0)
    q = jnp.asarray(rng.normal(0, 1, (B, HKV * G, D)).astype(np.float32))
    kn = vn = None
    if with_new:
        kn = jnp.asarray(rng.normal(0, 1, (B, HKV, D)).astype(np.float32))
        vn = jnp.asarray(rng.normal(0, 1, (B, HKV, D)).astype(np.float32))
    got = kernel(q, sch.kernel_format, st, cache.lengths, kn, vn, interpret=True, **kopts)
    want = O.decode_attention(q, st, np.asarray(cache.lengths), k_bits=s.k_bits, v_bits=s.v_bits, sink=s.sink,
                              key_stage=s.key_stage, theta=THETA, pairing=s.rope_pairing, k_new=kn, v_new=vn)
    return np.asarray(got, np.float64), want, (q, sch.kernel_format, st, kn, vn)


def rel_err(got, want):
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_float64_oracle(case):
    opts, kopts = CASES[case]
    s = make_scheme(**opts)
    cache, _ = filled(s, [27, 11])                     # ragged; 27 spans several blocks and both splits
    got, want, args = run_both(s, kopts, cache)
    assert rel_err(got, want) < 1e-3, rel_err(got, want)
    if s.k_sparse_capacity:                            # the sparse path was exercised
        assert (np.asarray(args[2].k_sp_idx)[:, :, :27] != 255).any()
    ref = decode_attention_kvquant_reference(*args[:2], args[2], cache.lengths, args[3], args[4])
    assert rel_err(np.asarray(ref, np.float64), want) < 1e-3
    # a sequence with an empty history (only the current token / only the sink) is still right
    empty, _ = filled(s, [0, 1])
    got, want, _ = run_both(s, kopts, empty)
    assert rel_err(got, want) < 1e-3


def test_in_kernel_rotation_equals_post_rope_row():
    """Pre-RoPE rows that the codebook represents exactly: decode + in-kernel RoPE at each stored position must
    reproduce attention over the post-RoPE rows the model appended (float64 attention on those rows)."""
    opts, kopts = CASES["nuq4_halfsplit_sink_sparse_splits"]
    s = make_scheme(**opts)
    cache, a = calibrated(s, seed=4, k_edge=0.96)      # keys stay strictly inside the calibrated range
    rng = np.random.default_rng(5)
    t = 25
    cbk, cbv = a["k_codebook"][0].astype(np.float64), a["v_codebook"][0].astype(np.float64)
    k_pre = cbk[rng.integers(0, 16, (B, t, HKV, D))] * a["k_scale"][0] + a["k_zero"][0]   # exactly representable
    k_post = O.rope64(k_pre, np.arange(t)[None, :, None], THETA, "half_split")
    # values: endpoints -2 / +2 in every row, the rest on the codebook: scale 2 and offset 0 are exact in fp16
    v = 2.0 * cbv[rng.integers(0, 16, (B, t, HKV, D))]
    v[..., 0], v[..., 1] = -2.0, 2.0
    cache = ops.append(cache, [(k_post.astype(np.float32), v.astype(np.float32))], t)
    sch, st = layer_state(cache, 0)
    assert (np.asarray(st.k_sp_idx)[:, :, 1:t] == 255).all()          # no outliers: pure LUT + RoPE path
    q = rng.normal(0, 1, (B, HKV * G, D))
    kn, vn = rng.normal(0, 1, (2, B, HKV, D)).astype(np.float32)                 # the current token
    got = np.asarray(kernel(jnp.asarray(q, jnp.float32), sch.kernel_format, st, cache.lengths, jnp.asarray(kn), jnp.asarray(vn),
                            interpret=True, **kopts), np.float64)
    want = np.zeros_like(q)
    kp = k_post.astype(np.float32).astype(np.float64)
    kp[:, 0] = O.f16(O.rope64(kp[:, 0], 0, THETA, "half_split", inverse=True))               # fp16 sink row
    vv = v.copy()
    vv[:, 0] = O.f16(v[:, 0])
    for b in range(B):
        for h in range(HKV * G):
            keys = np.concatenate([kp[b, :, h // G], kn[b, h // G][None]])
            vals = np.concatenate([vv[b, :, h // G], vn[b, h // G][None]])
            sc = keys @ q[b, h] / np.sqrt(D)
            p = np.exp(sc - sc.max())
            want[b, h] = (p / p.sum()) @ vals
    assert rel_err(got, want) < 1e-5, rel_err(got, want)


def test_channel_maps_pair_rope_partners_and_bad_inputs():
    for rope, partner in (("half_split", 16), ("interleaved", 1)):
        a, b, v = channel_maps(32, rope)
        assert sorted(np.concatenate([a, b]).tolist()) == list(range(32)) and sorted(v.tolist()) == list(range(32))
        np.testing.assert_array_equal(b - a, partner)                # column i of A and B: one RoPE pair
        if rope == "interleaved":
            assert (a % 2 == 0).all()
    a, _, v = channel_maps(32, "half_split")
    assert a[3 * 2 + 1] == 11 and v[1 * 4 + 2] == 17               # (r, j) -> 8 j + r; (r, J) -> 8 J + r
    with pytest.raises(ValueError, match="multiple of 16"):
        channel_maps(24, "half_split")
    opts, kopts = CASES["nuq3k_nuq2v_interleaved_dense"]
    s = make_scheme(**opts)
    cache, _ = calibrated(s)
    sch, st = layer_state(cache, 0)
    q = jnp.zeros((B, HKV * G, D), jnp.float32)
    with pytest.raises(ValueError, match="needs a KVQuantScheme"):
        decode_attention_kvquant(q, object(), st, cache.lengths)
    with pytest.raises(ValueError, match="one new token"):
        decode_attention_kvquant(q[:, None], sch.kernel_format, st, cache.lengths)
    with pytest.raises(ValueError, match="both k_new and v_new"):
        decode_attention_kvquant(q, sch.kernel_format, st, cache.lengths, k_new=jnp.zeros((B, HKV, D)))
    with pytest.raises(ValueError, match="multiple of Hkv"):
        decode_attention_kvquant(q[:, :5], sch.kernel_format, st, cache.lengths)
    with pytest.raises(ValueError, match="lengths must be"):
        decode_attention_kvquant(q, sch.kernel_format, st, cache.lengths[:1])


def test_dispatch_routes_kvquant_to_its_kernel_or_the_reference():
    """``attention.dispatch`` serves KVQuant (pre-RoPE storage): the fused kernel (forced, interpreted) and the
    reference (auto on CPU) both match the float64 oracle."""
    from kvquant_jax.attention import dispatch

    opts, _ = CASES["nuq4_halfsplit_sink_sparse_splits"]
    s = make_scheme(**opts)
    cache, _ = filled(s, [27, 11])
    _, want, (q, _, st, kn, vn) = run_both(s, dict(block_t=8, num_splits=2), cache)
    sch = layer_state(cache, 0)[0]
    got = dispatch.decode_attention(q, sch, st, cache.lengths, kn, vn, impl="kernel", interpret=True)
    assert rel_err(np.asarray(got, np.float64), want) < 1e-3
    auto = dispatch.decode_attention(q, sch, st, cache.lengths, kn, vn)
    ref = dispatch.decode_attention(q, sch, st, cache.lengths, kn, vn, impl="reference")
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(ref))
    assert rel_err(np.asarray(ref, np.float64), want) < 1e-3
    regions, tail_rows = dispatch.layer_regions(sch, st, cache.lengths)
    assert len(regions) == 1 and tail_rows == 0          # the reference view: materialized post-RoPE rows
