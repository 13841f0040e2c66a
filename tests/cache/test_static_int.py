"""Static-scale INTb cache and per-token INT3 (cache/static_int.py) against NumPy oracles."""
from __future__ import annotations

import numpy as np
import pytest

from kvquant_jax.cache import ops
from kvquant_jax.cache.interface import init_cache
from kvquant_jax.cache.per_token import PerTokenScheme
from kvquant_jax.cache.static_int import PerTokenAnyBitsScheme, StaticIntScheme, load_static_scales, per_token_int

L, B, H, D, C = 2, 2, 2, 8, 12


def rows(rng, t):
    return [tuple(rng.standard_normal((B, t, H, D)).astype(np.float32) * 2 for _ in range(2)) for _ in range(L)]


@pytest.mark.parametrize("bits,axis", [(4, "tensor"), (3, "head")])
def test_static_int_matches_oracle(bits, axis):
    rng = np.random.default_rng(bits)
    scheme = StaticIntScheme(bits=bits, scale_axis=axis, calibration_id="oracle-test")
    cache = init_cache(scheme, num_layers=L, batch=B, capacity=C, num_kv_heads=H, head_dim=D)
    ks = rng.uniform(0.1, 0.5, (L, 1 if axis == "tensor" else H)).astype(np.float32)
    vs = rng.uniform(0.1, 0.5, (L, 1 if axis == "tensor" else H)).astype(np.float32)
    cache = load_static_scales(cache, ks, vs)
    data = [rows(rng, 5), rows(rng, 1), rows(rng, 3)]
    for kv in data:
        cache = ops.append(cache, kv, kv[0][0].shape[1])
    ops.validate(cache)
    qmax = 2 ** (bits - 1) - 1
    with pytest.raises(ValueError, match="body rows"):
        load_static_scales(cache, ks, vs)
    for layer in range(L):
        k, v, valid = (np.asarray(a) for a in ops.decode_reference(cache, layer))
        assert valid.sum() == B * 9
        for got, src, s in ((k, 0, ks[layer]), (v, 1, vs[layer])):
            x = np.concatenate([d[layer][src] for d in data], axis=1).swapaxes(1, 2)       # [B, H, 9, D]
            s = np.broadcast_to(s, (H,)).astype(np.float32)[None, :, None, None]
            want = np.clip(np.rint(x / s), -qmax, qmax) * s                                 # saturating
            np.testing.assert_array_equal(got[:, :, :9], want.astype(np.float32))
            assert (np.abs(x) > qmax * s).any()                                             # clipping happened


def test_static_int_errors():
    with pytest.raises(ValueError, match="bits"):
        StaticIntScheme(bits=1)
    with pytest.raises(ValueError, match="scale_axis"):
        StaticIntScheme(scale_axis="token")
    cache = init_cache(StaticIntScheme(calibration_id="x"), num_layers=L, batch=B, capacity=C, num_kv_heads=H,
                       head_dim=D)
    with pytest.raises(ValueError, match="per-tensor"):
        load_static_scales(cache, np.ones((L, H)), np.ones((L, H)))
    with pytest.raises(ValueError, match="positive"):
        load_static_scales(cache, np.zeros(L), np.ones(L))
    with pytest.raises(ValueError, match="layers"):
        load_static_scales(cache, np.ones(L - 1), np.ones(L - 1))


def test_per_token_int3_matches_oracle():
    assert type(per_token_int(4)) is PerTokenScheme and type(per_token_int(3)) is PerTokenAnyBitsScheme
    rng = np.random.default_rng(0)
    scheme = per_token_int(3)
    cache = init_cache(scheme, num_layers=L, batch=B, capacity=C, num_kv_heads=H, head_dim=D)
    assert cache.groups[0].k_codes.shape[-1] == D * 3 // 8
    kv = rows(rng, 7)
    cache = ops.append(cache, kv, 7)
    ops.validate(cache)
    for layer in range(L):
        k, v, _ = (np.asarray(a) for a in ops.decode_reference(cache, layer))
        for got, x in ((k, kv[layer][0]), (v, kv[layer][1])):
            x = x.swapaxes(1, 2)
            scale = (np.abs(x).max(-1, keepdims=True) / np.float32(3)).astype(np.float16)
            want = np.clip(np.rint(x / scale.astype(np.float32)), -3, 3) * scale.astype(np.float32)
            np.testing.assert_allclose(got[:, :, :7], want, rtol=0, atol=1e-6)
