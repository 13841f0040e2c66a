"""prefill_attention.attend scores long forwards in query-row blocks: same result as one block and as a float64
NumPy oracle (history rows, causal current chunk, padding keys, sliding window, query start offsets)."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from kvquant_jax.models.prefill_attention import attend


def _oracle(q, kc, vc, num_new, hk, hv, valid, window, q_start):
    b, t, hq, d = q.shape
    hkv = kc.shape[2]
    g = hq // hkv
    out = np.zeros((b, t, hq, d))
    for bi in range(b):
        for h in range(hq):
            kh = h // g
            for ti in range(int(num_new[bi])):
                p = int(q_start[bi]) + ti
                keys, vals = [], []
                for c in range(hk.shape[2]):
                    if valid[bi, c] and (window == 0 or c > p - window):
                        keys.append(hk[bi, kh, c]); vals.append(hv[bi, kh, c])
                for s in range(ti + 1):
                    if window == 0 or ti - s < window:
                        keys.append(kc[bi, s, kh]); vals.append(vc[bi, s, kh])
                sc = np.asarray(keys) @ q[bi, ti, h] / np.sqrt(d)
                w = np.exp(sc - sc.max())
                out[bi, ti, h] = (w / w.sum()) @ np.asarray(vals)
    return out


@pytest.mark.parametrize("fixed_order", [False, True])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("block", [4, 7, 64])
def test_blocked_attend_equals_unblocked_and_the_float64_oracle(window, block, fixed_order):
    rng = np.random.default_rng(block + window)
    b, t, hq, hkv, d, c = 2, 19, 6, 2, 8, 11
    q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
    kc = rng.standard_normal((b, t, hkv, d)).astype(np.float32)
    vc = rng.standard_normal((b, t, hkv, d)).astype(np.float32)
    hk = rng.standard_normal((b, hkv, c, d)).astype(np.float32)
    hv = rng.standard_normal((b, hkv, c, d)).astype(np.float32)
    n_hist = np.array([c, 6])
    valid = np.arange(c)[None] < n_hist[:, None]
    num_new = np.array([t, 13], np.int32)
    q_start = n_hist.astype(np.int32)
    args = (jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(num_new),
            (jnp.asarray(hk), jnp.asarray(hv), jnp.asarray(valid)))
    kw = dict(window=window, q_start=jnp.asarray(q_start), fixed_order=fixed_order)
    blocked = np.asarray(jax.jit(lambda *a: attend(*a, **kw, query_block=block))(*args))
    whole = np.asarray(attend(*args, **kw, query_block=1024))
    ref = _oracle(q.astype(np.float64), kc, vc, num_new, hk, hv, valid, window, q_start)
    for bi in range(b):
        n = num_new[bi]
        np.testing.assert_allclose(blocked[bi, :n], whole[bi, :n], rtol=0, atol=2e-6)
        np.testing.assert_allclose(blocked[bi, :n], ref[bi, :n], rtol=0, atol=2e-5)
    assert blocked.shape == (b, t, hq, d) and blocked.dtype == np.float32


def test_attend_rejects_a_non_positive_query_block():
    z = jnp.zeros((1, 2, 2, 4))
    with pytest.raises(ValueError, match="query_block"):
        attend(z, z[:, :, :1], z[:, :, :1], jnp.array([2]), None, query_block=0)
