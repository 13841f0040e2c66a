"""Registry names / overrides / errors, mixed policies, schemas, and prefix reuse through check_compatible."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from kvquant_jax.cache import mixed, ops
from kvquant_jax.cache.fp8 import FP8Scheme, load_scales
from kvquant_jax.cache.full import FullPrecisionScheme
from kvquant_jax.cache.interface import init_cache
from kvquant_jax.cache.kivi import KIVIScheme
from kvquant_jax.cache.per_token import PerTokenScheme
from kvquant_jax.cache.qserve import QServeScheme
from kvquant_jax.cache.registry import NAMES, make_policy, make_scheme, scheme_from_config
from kvquant_jax.cache.reuse import reuse_prefix
from kvquant_jax.cache.schema import CacheSchema, IncompatibleSchemaError, check_compatible

from cache_helpers import B, CASES, D, H, L, new_cache, rows


def test_every_name_builds_and_round_trips_through_its_config():
    for name in NAMES:
        s = make_scheme(name, rope_theta=500000.0, rope_pairing="interleaved")
        assert s.schema.rope_theta == 500000.0 and s.schema.rope_pairing == "interleaved"
        assert scheme_from_config(s.config()) == s
        assert CacheSchema.from_json(s.schema.to_json()) == s.schema
        hash(s)
    assert make_scheme("kivi2") == KIVIScheme(k_bits=2, v_bits=2, group_size=32, v_group_size=32, residual=128)
    assert make_scheme("kivi4").k_bits == 4
    assert make_scheme("fp8_e5m2").fmt == "e5m2"
    assert make_scheme("int4") == PerTokenScheme(bits=4)
    assert isinstance(make_scheme("qserve4"), QServeScheme)
    assert make_scheme("bf16") == FullPrecisionScheme("bf16")


def test_overrides_dict_and_inline():
    s = make_scheme({"name": "kivi2", "bits": 4, "residual": 64, "group_size": 16, "rule": "synchronized"})
    assert (s.k_bits, s.v_bits, s.residual, s.group_size, s.residual_rule) == (4, 4, 64, 16, "synchronized")
    assert make_scheme("kivi2:residual=0,v_group_size=0") == KIVIScheme(residual=0, v_group_size=0)
    f = make_scheme({"scheme": "fp8_e4m3", "scales": "calibrated", "axis": "head", "k_scales": [0.1, 0.2],
                     "v_scales": [0.3, 0.4], "calibration_id": "llmc-abc"})
    assert f.k_scales == (0.1, 0.2) and f.schema.calibration_id == "llmc-abc"
    assert make_scheme("int8:group_size=32").group_size == 32


@pytest.mark.parametrize("spec, match", [
    ({"name": "kivi2", "residul": 64}, "unknown key 'residul'"),
    ("kivi2:gruop_size=4", "unknown key 'gruop_size'"),
    ({"name": "int8", "scales": "warmup"}, "unknown key 'scales'"),
    ("kivi3", "unknown cache scheme 'kivi3'"),
    ({"name": "kivi2", "residual": 48, "group_size": 32}, "multiple of group_size"),
    ({"name": "fp8_e4m3", "scales": "calibrated"}, "calibration_id"),
    ({"name": "int8", "bits": 3}, "bits"),
    ({"name": "kivi2", "rule": "rolling"}, "residual_rule"),
    ("kivi2:residual", "not key=value"),
    ({"residual": 3}, "no 'name'"),
])
def test_bad_specs_raise_naming_the_problem(spec, match):
    with pytest.raises(ValueError, match=match):
        make_scheme(spec)


def test_mixed_policies():
    base = make_scheme("kivi2", rope_theta=1e6)
    pol = make_policy({"name": "kivi2", "full_precision_first": 1, "full_precision_last": 2,
                       "full_precision_dtype": "bf16"}, 6, rope_theta=1e6)
    assert [type(p).__name__ for p in pol] == ["FullPrecisionScheme"] + ["KIVIScheme"] * 3 + \
        ["FullPrecisionScheme"] * 2
    assert pol[0] == FullPrecisionScheme("bf16", rope_theta=1e6) and pol[1] == base
    assert mixed.describe(pol) == "0: full(bf16) | 1-3: kivi | 4-5: full(bf16)"
    cache = init_cache(pol, num_layers=6, batch=1, capacity=8, num_kv_heads=1, head_dim=32)
    assert [(first, n) for _, first, n in cache.schemes] == [(0, 1), (1, 3), (4, 2)]
    assert mixed.skip_layers(FP8Scheme(), 3, [1])[1] == FullPrecisionScheme("fp32")
    with pytest.raises(ValueError, match="invalid"):
        mixed.with_full_precision(base, 4, layers=[7])


def test_fp8_load_scales_sets_per_layer_calibration_and_refuses_late_changes():
    fp8 = FP8Scheme("e4m3", scales="calibrated", scale_axis="head", calibration_id="cal-1")
    policy = mixed.skip_layers(fp8, 3, [0])
    cache = init_cache(policy, num_layers=3, batch=1, capacity=4, num_kv_heads=2, head_dim=8)
    ks = np.array([[9, 9], [0.5, 0.25], [2, 4]], np.float32)
    cache = load_scales(cache, ks, ks * 2)
    np.testing.assert_array_equal(np.asarray(cache.groups[1].k_scale), ks[1:])
    np.testing.assert_array_equal(np.asarray(cache.groups[1].v_scale), 2 * ks[1:])
    cache = ops.append(cache, [(np.ones((1, 1, 2, 8), np.float32),) * 2] * 3, 1)
    ops.validate(cache)
    with pytest.raises(ValueError, match="already holds rows"):
        load_scales(cache, ks, ks)
    with pytest.raises(ValueError, match="not 'calibrated'"):
        load_scales(init_cache(FP8Scheme(), num_layers=1, batch=1, capacity=4, num_kv_heads=2, head_dim=8),
                    [1.0], [1.0])


def test_check_compatible_lists_every_difference():
    a = make_scheme("kivi2")
    b = dataclasses.replace(a, residual=64, key_stage="pre_rope")
    fields = [f for f, _, _ in check_compatible(a, b).differences]
    assert fields == ["key_stage", "residual"]


def _prefix(policy, rng):
    """A one-sequence prefix cache of 6 rows, in the shared test shapes (so nothing new is compiled)."""
    pairs = rows(rng, 5)
    cache = ops.append(new_cache(policy), pairs, np.array([5, 0, 0]))
    one = rows(rng, 1)
    cache = ops.append(cache, one, np.array([1, 0, 0]))
    prefix_rows = tuple((np.concatenate([k[:1], k1[:1]], axis=1), np.concatenate([v[:1], v1[:1]], axis=1))
                        for (k, v), (k1, v1) in zip(pairs, one))
    return ops.fork(cache, np.array([0])), prefix_rows


@pytest.mark.parametrize("prefix_scheme, request_scheme, field", [
    (KIVIScheme(group_size=4, v_group_size=4, residual=8, key_stage="pre_rope"),
     FP8Scheme("e4m3"), "key_stage"),                           # pre-RoPE per-channel K vs post-RoPE FP8 K
    (FP8Scheme("e4m3", scales="calibrated", calibration_id="cal-A", k_scales=(0.1,), v_scales=(0.1,)),
     FP8Scheme("e4m3", scales="calibrated", calibration_id="cal-B", k_scales=(0.1,), v_scales=(0.1,)),
     "calibration_id"),
    (PerTokenScheme(bits=4, rope_theta=10000.0), PerTokenScheme(bits=4, rope_theta=500000.0), "rope_theta"),
    (QServeScheme(tokenizer_hash="sha256:aaa"), QServeScheme(tokenizer_hash="sha256:bbb"), "tokenizer_hash"),
])
def test_prefix_reuse_refuses_a_schema_mismatch(prefix_scheme, request_scheme, field):
    prefix = init_cache(prefix_scheme, num_layers=L, batch=1, capacity=8, num_kv_heads=H, head_dim=D)
    with pytest.raises(IncompatibleSchemaError, match=field) as e:
        reuse_prefix(prefix, request_scheme)
    assert any(f.endswith("." + field) for f, _, _ in e.value.compatibility.differences)
    assert reuse_prefix(prefix, prefix_scheme, ignore=()) is prefix


def test_prefix_reuse_forks_and_grows_then_equals_a_cache_built_from_scratch():
    policy = CASES["kivi2_official"]
    rng = np.random.default_rng(1)
    prefix, prefix_rows = _prefix(policy, rng)
    assert prefix.batch == 1 and int(prefix.lengths[0]) == 6
    req = reuse_prefix(prefix, policy, batch=B)
    ops.validate(req)
    scratch = ops.append(new_cache(policy), tuple((np.repeat(k[:, :5], B, 0), np.repeat(v[:, :5], B, 0))
                                                  for k, v in prefix_rows), 5)
    scratch = ops.append(scratch, tuple((np.repeat(k[:, 5:], B, 0), np.repeat(v[:, 5:], B, 0))
                                        for k, v in prefix_rows), 1)
    more = rows(rng, 5)
    a = ops.append(req, more, np.array([5, 3, 1]))
    b = ops.append(scratch, more, np.array([5, 3, 1]))
    for x, y in zip(jax.tree.leaves(ops.decode_all(a)), jax.tree.leaves(ops.decode_all(b))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # growing the capacity keeps every stored byte and the decoded view
    grown = reuse_prefix(prefix, policy, capacity=40)
    assert grown.capacity == 40
    ops.validate(grown)
    for x, y in zip(ops.decode_reference(prefix, 1), ops.decode_reference(grown, 1)):
        np.testing.assert_array_equal(np.asarray(x)[..., :24, :] if np.ndim(x) == 4 else np.asarray(x)[:, :24],
                                      np.asarray(y)[..., :24, :] if np.ndim(y) == 4 else np.asarray(y)[:, :24])
    with pytest.raises(ValueError, match="ONE prefix sequence"):
        reuse_prefix(req, policy, batch=2)
    with pytest.raises(ValueError, match="below a committed length"):
        ops.resize(a, 4)
