"""decode_attention(q, scheme, layer_state, lengths, k_new, v_new) on real cache states vs the float64 oracle.

The ground truth is built independently of the dispatcher's region adapters: the scheme's own
``materialize_layer`` (the cache owner's decoder) gives dense K/V and validity, and the float64 oracle attends over
them plus the current token.  Caches are filled through ``append_layer`` (ragged prefill + decode steps) so KIVI
frontiers land before / on / after a residual-chunk closure.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.attention import dispatch
from kvquant_jax.abi.reference import decode_attention_reference
from kvquant_jax.abi.regions import dense_operand, region
from kvquant_jax.cache.prefix import PrefixScheme
from kvquant_jax.cache.registry import make_scheme
from kvquant_jax.cache.static_int import StaticIntScheme
from pallas_kernels.decode_attention import KernelConfig

B, HKV, D, C = 3, 2, 32, 96
PREFILL = np.array([31, 45, 62], np.int32)      # + 2 decode steps -> 33, 47, 64 (R = 32: after / inside / on)

SPECS = {
    "bf16": "bf16",
    "fp8": "fp8_e4m3",
    "int8": "int8",
    "int4g": "int4:group_size=16",
    "int2": "int2",
    "qserve": "qserve4",
    "kivi2": "kivi2:residual=32,group_size=16,v_group_size=16",
    "kivi4_sync": "kivi4:residual=32,group_size=16,v_group_size=0,residual_rule=synchronized",
    "kivi2_r0": "kivi2:residual=0,group_size=16,v_group_size=8",
}
KERNEL = ("bf16", "fp8", "int4g", "qserve", "kivi2", "kivi4_sync", "kivi2_r0", "static_int4", "prefix_kivi2")


def _scheme(name):
    if name == "static_int4":
        return StaticIntScheme(bits=4)
    if name == "prefix_kivi2":
        return PrefixScheme(body=make_scheme(SPECS["kivi2"]), prefix_len=3, shared=True)
    return make_scheme(SPECS[name])


def _filled(rng, scheme):
    st = scheme.init_layer(B, C, HKV, D)
    lengths = jnp.zeros((B,), jnp.int32)
    if isinstance(scheme, PrefixScheme):
        p = scheme.prefix_len
        pk = jnp.asarray(rng.standard_normal((1, HKV, p, D)).astype(np.float32))
        pv = jnp.asarray(rng.standard_normal((1, HKV, p, D)).astype(np.float32))
        st = st.replace(prefix_k=pk, prefix_v=pv) if hasattr(st, "replace") else st
        lengths = jnp.full((B,), p, jnp.int32)
    steps = [(jnp.asarray(PREFILL), int(PREFILL.max()))] + [(jnp.ones((B,), jnp.int32), 1)] * 2
    append = jax.jit(scheme.append_layer)
    for num_new, t in steps:
        k = jnp.asarray(rng.standard_normal((B, t, HKV, D)).astype(np.float32))
        v = jnp.asarray(rng.standard_normal((B, t, HKV, D)).astype(np.float32))
        st = append(st, lengths, k, v, num_new)
        lengths = lengths + num_new
    return st, lengths


def _oracle(scheme, st, lengths, q, kn, vn):
    k, v, valid = scheme.materialize_layer(st, lengths)
    n = k.shape[2]
    assert bool(jnp.all(valid == (jnp.arange(n)[None, :] < lengths[:, None])))
    return decode_attention_reference(np.asarray(q), [region(dense_operand(k), dense_operand(v), lengths)],
                                      k_new=kn, v_new=vn)


def _inputs(rng, gqa=2):
    q = jnp.asarray(rng.standard_normal((B, HKV * gqa, D)).astype(np.float32))
    kn = jnp.asarray(rng.standard_normal((B, HKV, D)).astype(np.float32))
    vn = jnp.asarray(rng.standard_normal((B, HKV, D)).astype(np.float32))
    return q, kn, vn


def _rel(out, ref):
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all()
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("name", sorted(SPECS) + ["static_int4", "prefix_kivi2"])
def test_reference_impl_matches_materialized_oracle(rng, name):
    scheme = _scheme(name)
    st, lengths = _filled(rng, scheme)
    q, kn, vn = _inputs(rng, gqa=3)
    ref = _oracle(scheme, st, lengths, q, kn, vn)
    out = jax.jit(lambda q, st, lengths, kn, vn: dispatch.decode_attention(q, scheme, st, lengths, kn, vn,
                                                                           impl="reference"))(q, st, lengths, kn, vn)
    assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize("name", KERNEL)
def test_kernel_impl_matches_materialized_oracle(rng, name):
    scheme = _scheme(name)
    st, lengths = _filled(rng, scheme)
    q, kn, vn = _inputs(rng, gqa=2)
    ref = _oracle(scheme, st, lengths, q, kn, vn)
    out = dispatch.decode_attention(q, scheme, st, lengths, kn, vn, impl="kernel", interpret=True,
                                    config=KernelConfig(block_t=32, num_splits=2))
    assert _rel(out, ref) < 1e-3


def test_auto_on_cpu_is_the_reference(rng):
    scheme = _scheme("int4g")
    st, lengths = _filled(rng, scheme)
    q, kn, vn = _inputs(rng)
    auto = dispatch.decode_attention(q, scheme, st, lengths, kn, vn)
    ref = dispatch.decode_attention(q, scheme, st, lengths, kn, vn, impl="reference")
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(ref))


def test_kivi_tail_covers_both_frontiers(rng):
    """Under the official rule the dispatcher's tail starts at the V frontier and holds max(S_k, S_v) rows."""
    scheme = _scheme("kivi2")
    st, lengths = _filled(rng, scheme)
    regions, tail_rows = dispatch.layer_regions(scheme, st, lengths)
    fk, fv = scheme.frontiers(lengths)
    assert tail_rows == max(scheme.ring_sizes)
    np.testing.assert_array_equal(np.asarray(regions[0].end), np.minimum(np.asarray(fk), np.asarray(fv)))
    np.testing.assert_array_equal(np.asarray(regions[1].end), np.asarray(lengths - regions[0].end))


def test_bad_use_raises(rng):
    scheme = make_scheme("int4")
    st, lengths = _filled(rng, scheme)
    q, kn, vn = _inputs(rng)
    with pytest.raises(ValueError, match="impl"):
        dispatch.decode_attention(q, scheme, st, lengths, kn, vn, impl="cuda")
    pre = make_scheme({"name": "int4", "key_stage": "pre_rope"})
    with pytest.raises(ValueError, match="post-RoPE"):
        dispatch.decode_attention(q, pre, st, lengths, kn, vn)
