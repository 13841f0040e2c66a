"""Issue Q.9: a non-default ``sm_scale`` reaches the logits on every path that accepts it (a planted bug where
``pallas_kernels.decode_attention_reference`` ignored it passed the whole kernel test file).

Oracle: float64 NumPy softmax attention over the live rows plus the current token, written here from the
definition; every check also asserts that the default-scale answer is far from it, so ignoring ``sm_scale`` fails.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.abi import reference as R
from kvquant_jax.abi.regions import dense_operand, region
from pallas_kernels import decode_attention as da

B, HKV, G, N, D = 2, 2, 3, 16, 16
SCALES = (0.07, 1.3)                  # default is 1/sqrt(16) = 0.25
TOL = 1e-3


def oracle(q, k, v, start, end, kn, vn, s):
    """q [B, Hq, D]; k, v [B, Hkv, N, D] (rows [start, end) live); kn, vn [B, Hkv, D] or None."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, hq, d = q.shape
    g = hq // k.shape[1]
    out = np.zeros((b, hq, d))
    for bi in range(b):
        for h in range(hq):
            kh = h // g
            ks, vs = k[bi, kh, start[bi]:end[bi]], v[bi, kh, start[bi]:end[bi]]
            if kn is not None:
                ks = np.concatenate([ks, np.asarray(kn, np.float64)[bi, kh][None]])
                vs = np.concatenate([vs, np.asarray(vn, np.float64)[bi, kh][None]])
            logit = ks @ q[bi, h] * s
            p = np.exp(logit - logit.max())
            out[bi, h] = (p / p.sum()) @ vs
    return out


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.fixture
def case():
    rng = np.random.default_rng(17)
    q = rng.standard_normal((B, HKV * G, D)).astype(np.float32) * 2
    k = rng.standard_normal((B, HKV, N, D)).astype(np.float32)
    v = rng.standard_normal((B, HKV, N, D)).astype(np.float32)
    kn = rng.standard_normal((B, HKV, D)).astype(np.float32)
    vn = rng.standard_normal((B, HKV, D)).astype(np.float32)
    start, end = np.array([0, 3]), np.array([N, 11])
    reg = region(dense_operand(jnp.asarray(k)), dense_operand(jnp.asarray(v)), end, start)
    return q, k, v, kn, vn, start, end, reg


def _check(fn, case, s):
    q, k, v, kn, vn, start, end, _ = case
    want = oracle(q, k, v, start, end, kn, vn, s)
    default = oracle(q, k, v, start, end, kn, vn, 1 / np.sqrt(D))
    assert rel(default, want) > 0.05                   # the test can tell the scales apart
    got = fn(s)
    assert rel(got, want) < TOL, (s, rel(got, want))


@pytest.mark.parametrize("s", SCALES)
def test_pallas_kernel_sm_scale(case, s):
    q, _, _, kn, vn, _, _, reg = case
    _check(lambda s: da.decode_attention(jnp.asarray(q), [reg], k_new=jnp.asarray(kn), v_new=jnp.asarray(vn),
                                         sm_scale=s, backend="gpu", interpret=True,
                                         config=da.KernelConfig(block_t=8, num_splits=2)), case, s)


@pytest.mark.parametrize("s", SCALES)
def test_pallas_kernel_sm_scale_small_rows_path(case, s):
    """small_rows sends the region through the plain-JAX partial, merged into the same softmax."""
    q, _, _, kn, vn, _, _, reg = case
    _check(lambda s: da.decode_attention(jnp.asarray(q), [reg], k_new=jnp.asarray(kn), v_new=jnp.asarray(vn),
                                         sm_scale=s, backend="gpu", interpret=True, small_rows=N), case, s)


@pytest.mark.parametrize("s", SCALES)
def test_pallas_reference_twin_sm_scale(case, s):
    q, _, _, kn, vn, _, _, reg = case
    _check(lambda s: da.decode_attention_reference(jnp.asarray(q), [reg], k_new=jnp.asarray(kn),
                                                   v_new=jnp.asarray(vn), sm_scale=s), case, s)


@pytest.mark.parametrize("s", SCALES)
def test_attention_reference_and_jnp_sm_scale(case, s):
    q, _, _, kn, vn, _, _, reg = case
    _check(lambda s: R.decode_attention_reference(q, [reg], k_new=kn, v_new=vn, sm_scale=s), case, s)
    _check(lambda s: R.decode_attention_jnp(jnp.asarray(q), [reg], k_new=jnp.asarray(kn), v_new=jnp.asarray(vn),
                                            sm_scale=s), case, s)


@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_dispatch_sm_scale(impl):
    """kvquant_jax.attention.dispatch over a full-precision cache layer (rows appended through the cache API)."""
    from kvquant_jax.attention.dispatch import decode_attention
    from kvquant_jax.cache import ops
    from kvquant_jax.cache.interface import init_cache, layer_state
    from kvquant_jax.cache.registry import make_scheme

    rng = np.random.default_rng(23)
    lengths = np.array([N, 9])
    k = rng.standard_normal((B, N, HKV, D)).astype(np.float32)
    v = rng.standard_normal((B, N, HKV, D)).astype(np.float32)
    cache = ops.append(init_cache(make_scheme("fp32"), num_layers=1, batch=B, capacity=N, num_kv_heads=HKV,
                                  head_dim=D), [(k, v)], lengths)
    sch, st = layer_state(cache, 0)
    q = rng.standard_normal((B, HKV * G, D)).astype(np.float32) * 2
    kn = rng.standard_normal((B, HKV, D)).astype(np.float32)
    vn = rng.standard_normal((B, HKV, D)).astype(np.float32)
    kh, vh = np.swapaxes(k, 1, 2), np.swapaxes(v, 1, 2)
    zeros = np.zeros(B, int)
    for s in SCALES:
        want = oracle(q, kh, vh, zeros, lengths, kn, vn, s)
        assert rel(oracle(q, kh, vh, zeros, lengths, kn, vn, 0.25), want) > 0.05
        got = decode_attention(jnp.asarray(q), sch, st, cache.lengths, jnp.asarray(kn), jnp.asarray(vn), impl=impl,
                               interpret=True, backend="gpu", sm_scale=s)
        assert rel(got, want) < TOL, (impl, s)


def test_kvquant_kernel_and_twin_sm_scale():
    from kvquant_jax.cache.interface import layer_state
    from pallas_kernels.decode_attention_kvquant import decode_attention_kvquant, decode_attention_kvquant_reference
    from test_decode_attention_kvquant import B as KB, D as KD, G as KG, HKV as KH, filled, make_scheme

    s_ = make_scheme(k_bits=4, v_bits=4, k_sparse_capacity=1, v_outliers=1, sink=1)
    cache, _ = filled(s_, [20, 7])
    sch, st = layer_state(cache, 0)
    rng = np.random.default_rng(3)
    q = rng.normal(0, 2, (KB, KH * KG, KD)).astype(np.float32)
    kn = rng.normal(0, 1, (KB, KH, KD)).astype(np.float32)
    vn = rng.normal(0, 1, (KB, KH, KD)).astype(np.float32)
    # the stored (dequantized, post-RoPE) rows are the operand; the oracle applies the scale from the definition
    kd, vd, _ = jax.jit(sch.materialize_layer)(st, cache.lengths)
    lengths = np.asarray(cache.lengths)
    zeros = np.zeros(KB, int)
    for s in SCALES:
        want = oracle(q, kd, vd, zeros, lengths, kn, vn, s)
        assert rel(oracle(q, kd, vd, zeros, lengths, kn, vn, 1 / np.sqrt(KD)), want) > 0.05
        got = decode_attention_kvquant(jnp.asarray(q), sch.kernel_format, st, cache.lengths, jnp.asarray(kn), jnp.asarray(vn),
                                       sm_scale=s, interpret=True, block_t=8, num_splits=2)
        assert rel(got, want) < TOL, ("kernel", s, rel(got, want))
        twin = decode_attention_kvquant_reference(jnp.asarray(q), sch.kernel_format, st, cache.lengths, jnp.asarray(kn),
                                                  jnp.asarray(vn), sm_scale=s)
        assert rel(twin, want) < TOL, ("twin", s)
