"""The K/V-split scheme (``kv``: keys in one format, values in another) against an independent float64 NumPy
oracle, plus its schema, status, ledger and refusal contracts.  (Serialization / registry / paged / sharding round
trips run through tests/cache/family_specs.py.)"""
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.attention import dispatch
from kvquant_jax.cache import ops
from kvquant_jax.cache.interface import init_cache, layer_state
from kvquant_jax.cache.kv_split import KVSplitScheme, tensor_bits, tensor_of
from kvquant_jax.cache.registry import make_scheme
from kvquant_jax.cache.schema import IncompatibleSchemaError, check_compatible, require_compatible

B, H, HQ, T, D, C = 2, 2, 4, 6, 16, 8


def _rows(seed):
    rng = np.random.default_rng(seed)
    k, v = rng.normal(0, 1.5, (2, B, T, H, D))
    return k + np.sign(k) * 0.05, v + np.sign(v) * 0.05      # non-zero everywhere


def _oracle_int_per_token(x, bits):
    """float64 per-(token, head) symmetric INTb with an fp16-stored scale: x [..., D]."""
    qmax = 2 ** (bits - 1) - 1
    scale = (np.abs(x).max(-1, keepdims=True) / qmax).astype(np.float16).astype(np.float64)
    return np.clip(np.rint(x / scale), -qmax, qmax) * scale


def _filled(spec, k, v, num_new):
    scheme = make_scheme(spec)
    cache = init_cache(scheme, num_layers=1, batch=B, capacity=C, num_kv_heads=H, head_dim=D)
    return scheme, ops.append(cache, [(jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32))],
                              num_new=jnp.asarray(num_new, jnp.int32))


def _softmax_attention64(q, k, v):
    """q [Hq, D], k/v [N, Hkv, D] float64 -> [Hq, D] (GQA: query head h reads KV head h // (Hq / Hkv))."""
    g = q.shape[0] // k.shape[1]
    out = np.zeros_like(q)
    for h in range(q.shape[0]):
        s = k[:, h // g] @ q[h] / np.sqrt(q.shape[1])
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ v[:, h // g]
    return out


def _assert_decode_matches_oracle(out, q, want_k, want_v, kn, vn, num_new):
    """One decode step's attention ``out [B, Hq, D]`` over each sequence's ``num_new`` oracle rows plus the exact
    current token equals the float64 softmax attention."""
    for b in range(len(num_new)):
        n = num_new[b]
        kk = np.concatenate([want_k[b, :n], kn[b][None].astype(np.float64)])
        vv = np.concatenate([want_v[b, :n], vn[b][None].astype(np.float64)])
        np.testing.assert_allclose(out[b], _softmax_attention64(q[b].astype(np.float64), kk, vv),
                                   rtol=1e-4, atol=1e-5)


def test_int4_keys_fp16_values_match_float64_oracle_and_reference_attention():
    k, v = _rows(0)
    num_new = np.array([T, 4])
    scheme, cache = _filled({"name": "kv", "k": "int4", "v": "fp16"}, k, v, num_new)
    got_k, got_v = (np.asarray(a) for a in ops.decode_reference(cache, 0)[:2])
    want_k = _oracle_int_per_token(k.astype(np.float32).astype(np.float64), 4)       # [B, T, H, D]
    want_v = v.astype(np.float16).astype(np.float64)
    for b in range(B):
        n = num_new[b]
        # the stored scale is one fp16 value: codes agree exactly, values to float32 rounding of code * scale
        np.testing.assert_allclose(got_k[b, :, :n].transpose(1, 0, 2), want_k[b, :n], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(got_v[b, :, :n].transpose(1, 0, 2), want_v[b, :n], rtol=0, atol=0)
        assert not got_k[b, :, n:].any() and not got_v[b, :, n:].any()
    rng = np.random.default_rng(1)
    q = rng.normal(0, 1, (B, HQ, D)).astype(np.float32)
    kn, vn = rng.normal(0, 1, (2, B, H, D)).astype(np.float32)
    sch, st = layer_state(cache, 0)
    out = np.asarray(dispatch.decode_attention(jnp.asarray(q), sch, st, cache.lengths, kn, vn, impl="reference"))
    _assert_decode_matches_oracle(out, q, want_k, want_v, kn, vn, num_new)


def test_kivi_values_keep_their_own_residual_ring():
    """V in KIVI-2 (residual 4 rows exact) and K in int8: each half keeps its component's representation."""
    k, v = _rows(2)
    kivi = {"name": "kivi2", "group_size": 4, "v_group_size": 4, "residual": 4}
    _, cache = _filled({"name": "kv", "k": "int8", "v": kivi}, k, v, [T, T])
    _, ref_k = _filled("int8", k, v, [T, T])
    _, ref_v = _filled(kivi, k, v, [T, T])
    got = ops.decode_reference(cache, 0)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(ops.decode_reference(ref_k, 0)[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(ops.decode_reference(ref_v, 0)[1]))


def test_status_concerns_each_tensor_only():
    """fp16 keys cannot hold 1e6 (inf); int8 values can: a huge V row is accepted, a huge K row rejected."""
    k, v = _rows(3)
    big = np.full_like(v, 1e6)
    for kk, vv, ok in ((k, big, True), (big, v, False)):
        scheme = make_scheme("kv:k=fp16,v=int8")
        st = scheme.init_layer(B, C, H, D)
        _, status = scheme.append_layer_with_status(st, jnp.zeros((B,), jnp.int32), jnp.asarray(kk, jnp.float32),
                                                    jnp.asarray(vv, jnp.float32), jnp.full((B,), T, jnp.int32))
        assert np.asarray(status).tolist() == [ok] * B


def test_schema_names_both_components_and_reuse_refuses_any_difference():
    a, b = make_scheme("kv:k=int4,v=fp16"), make_scheme("kv:k=int4,v=bf16")
    assert a.schema.key == make_scheme("int4").schema.key and a.schema.value == make_scheme("fp16").schema.value
    diff = check_compatible(a.schema, b.schema)
    assert not diff.ok and any("value" in f for f in diff.describe().split()) and "v_schema" in diff.describe()
    with pytest.raises(IncompatibleSchemaError):
        require_compatible(a.schema, b.schema)
    assert check_compatible(a.schema, make_scheme({"name": "kv", "k": "int4", "v": "fp16"}).schema).ok


def test_ledger_counts_each_tensor_of_its_own_component():
    s = make_scheme("kv:k=int8,v=int4")
    assert tensor_bits(s, "k", rows=64, num_kv_heads=3, head_dim=64) == \
        tensor_bits(make_scheme("int8"), "k", rows=64, num_kv_heads=3, head_dim=64) == 8.25
    assert tensor_bits(s, "v", rows=64, num_kv_heads=3, head_dim=64) == 4.25
    with pytest.raises(ValueError, match="tensor must be 'k' or 'v'"):
        tensor_bits(s, "q", rows=64, num_kv_heads=3, head_dim=64)


@pytest.mark.parametrize("spec, match", [
    ({"name": "kv", "k": "int4", "v": "int9"}, "unknown cache scheme 'int9'"),
    ({"name": "kv", "k": "int4", "v": {"name": "prefix", "prefix_len": 2, "body": "int4"}}, "is a wrapper"),
    ({"name": "kv", "k": {"name": "kvquant", "bits": 3}, "v": "int4"}, "pre-RoPE"),
    ({"name": "kv", "k": "int4", "v": "int4", "w": "int8"}, "unknown key 'w'"),
])
def test_bad_specs_name_the_problem(spec, match):
    with pytest.raises(ValueError, match=match):
        make_scheme(spec)


def test_rope_identity_must_agree_and_unsplittable_fields_are_named():
    with pytest.raises(ValueError, match="v must be a cache scheme spec"):
        KVSplitScheme(k=make_scheme("int4"), v="int4")
    with pytest.raises(ValueError, match="disagree on"):
        KVSplitScheme(k=make_scheme("int4", rope_theta=1e4), v=make_scheme("int4", rope_theta=1e5))
    assert tensor_of("k_codes") == "k" and tensor_of("v") == "v"
    with pytest.raises(TypeError, match="'pos' belongs to neither K nor V"):
        tensor_of("pos")


def test_region_kernel_reads_mixed_k_and_v_formats_in_place():
    """int4 keys + fp16 values as ONE region (each operand its own format): the Pallas region kernel (interpreted
    on CPU) equals the float64 oracle of the stored rows."""
    k, v = _rows(5)
    num_new = np.array([T, 4])
    scheme, cache = _filled("kv:k=int4,v=fp16", k, v, num_new)
    sch, st = layer_state(cache, 0)
    regions, tail = sch.decode_regions(st, cache.lengths)
    assert tail == 0 and len(regions) == 1
    assert (regions[0].k.fmt.payload, regions[0].v.fmt.payload) == ("int4", "fp16")
    rng = np.random.default_rng(6)
    q = rng.normal(0, 1, (B, HQ, D)).astype(np.float32)
    kn, vn = rng.normal(0, 1, (2, B, H, D)).astype(np.float32)
    out = np.asarray(dispatch.decode_attention(jnp.asarray(q), sch, st, cache.lengths, kn, vn, impl="kernel"))
    want_k = _oracle_int_per_token(k.astype(np.float32).astype(np.float64), 4)
    want_v = v.astype(np.float16).astype(np.float64)
    _assert_decode_matches_oracle(out, q, want_k, want_v, kn, vn, num_new)
