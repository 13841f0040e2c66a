"""Every registered family: config spec -> scheme -> cache -> serialize -> restore -> equal materialize; and the
worked example of adding a scheme (one file, one registry entry) served by dispatch, ledger and serialization."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from kvquant_jax.abi.reference import decode_attention_reference
from kvquant_jax.abi.regions import dense_operand, region
from kvquant_jax.attention import dispatch
from kvquant_jax.cache import ops, registry, serialize
from kvquant_jax.cache.interface import init_cache, layer_state
from kvquant_jax.cache.registry import FAMILIES, NAMES, make_scheme, scheme_from_config
from kvquant_jax.quant.ledger import LedgerShape, ledger, measured_nbytes

from example_scheme import K16V8Scheme
from family_specs import KIVI, SPECS  # noqa: F401 - one spec per registered family (a new family adds its line)

L, B, H, D, C, T = 2, 2, 2, 32, 48, 21


def _filled(scheme, seed=0):
    rng = np.random.default_rng(seed)
    cache = init_cache(scheme, num_layers=L, batch=B, capacity=C, num_kv_heads=H, head_dim=D)
    p = getattr(scheme, "prefix_len", 0)
    if p:                                                     # prefix rows first (start_request's lengths == P)
        cache = cache.replace(lengths=cache.lengths + p)
    kv = [(rng.normal(0, 1, (B, T, H, D)).astype(np.float32), rng.normal(0, 1, (B, T, H, D)).astype(np.float32))
          for _ in range(L)]
    return ops.append(cache, kv, np.array([T, T - 6]))


def test_every_family_has_a_round_trip_spec():
    assert set(SPECS) == set(FAMILIES)
    assert {NAMES[registry.normalize_spec(s)["name"]][0].family for s in SPECS.values()} == set(FAMILIES)


@pytest.mark.parametrize("family", sorted(SPECS))
def test_config_scheme_cache_serialize_restore_materialize(family):
    scheme = make_scheme(SPECS[family], rope_theta=50000.0, rope_pairing="interleaved")
    assert scheme.family == family
    assert scheme_from_config(json.loads(json.dumps(scheme.config()))) == scheme
    cache = _filled(scheme)
    back = serialize.from_bytes(serialize.to_bytes(cache))
    assert back.schemes == cache.schemes and back.schemas == cache.schemas
    np.testing.assert_array_equal(np.asarray(back.lengths), np.asarray(cache.lengths))
    for layer in range(L):
        for a, b in zip(ops.decode_reference(cache, layer), ops.decode_reference(back, layer)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    led = ledger(scheme, LedgerShape(L, B, H, D, T, C))
    assert led.physical == measured_nbytes(cache)
    _check_dispatch(back, layer=1)


def _check_dispatch(cache, layer, seed=4):
    """The scheme's decode regions (read in place) against the float64 oracle over its materialize view."""
    rng = np.random.default_rng(seed)
    q = rng.normal(0, 1, (B, 2 * H, D)).astype(np.float32)
    kn, vn = rng.normal(0, 1, (2, B, H, D)).astype(np.float32)
    sch, st = layer_state(cache, layer)
    out = dispatch.decode_attention(jax.numpy.asarray(q), sch, st, cache.lengths, kn, vn, impl="reference")
    k, v, valid = (np.asarray(a) for a in sch.materialize_layer(st, cache.lengths))
    want = []
    for b in range(B):           # the valid rows of each sequence (a window ring's are not a prefix of the rows)
        idx = np.flatnonzero(valid[b])
        r = region(dense_operand(k[b:b + 1][:, :, idx]), dense_operand(v[b:b + 1][:, :, idx]), np.array([idx.size]))
        want.append(decode_attention_reference(q[b:b + 1], [r], k_new=kn[b:b + 1], v_new=vn[b:b + 1]))
    np.testing.assert_allclose(np.asarray(out), np.concatenate(want), rtol=1e-4, atol=1e-5)
    return sch, st


def test_adding_a_scheme_is_one_file_and_one_registry_entry(monkeypatch):
    """docs/architecture.md, "Adding a scheme": the registry entry is ``SCHEME_CLASSES + (K16V8Scheme,)``."""
    classes = registry.SCHEME_CLASSES + (K16V8Scheme,)
    monkeypatch.setattr(registry, "FAMILIES", registry._families(classes))
    monkeypatch.setattr(registry, "NAMES", registry._names(classes))
    monkeypatch.setattr(registry, "ALIASES", {c: dict(c.aliases) for c in classes})
    scheme = make_scheme("k16v8")                                         # config name -> scheme
    cache = _filled(scheme, seed=3)
    # serialization: restore rebuilds the scheme from its config through the registry
    back = serialize.from_bytes(serialize.to_bytes(cache))
    assert back.schemes == cache.schemes
    # ledger: the scheme's own formula, physical == measured
    assert ledger(scheme, LedgerShape(L, B, H, D, T, C)).physical == measured_nbytes(cache)
    # dispatch: the scheme's regions (read in place) against the float64 oracle over its materialize view
    sch, st = _check_dispatch(back, layer=1)
    regions, _ = dispatch.layer_regions(sch, st, back.lengths)
    assert regions[0].v.fmt.payload == "int8"                          # the INT8 codes are read where they lie
