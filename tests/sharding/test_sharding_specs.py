"""kvquant_jax.sharding: mesh parsing and checks, Megatron weight specs, every scheme's cache field specs, the
per-device ledger against the arrays' addressable shards, and bit-identical appends across tensor-parallel sizes
(the unsharded append is the oracle).  CPU, 8 host devices (tests/conftest.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from kvquant_jax import sharding as S
from kvquant_jax.attention import dispatch
from kvquant_jax.attention.sharded import local_layer
from kvquant_jax.cache.interface import init_cache, layer_state
from kvquant_jax.cache.registry import FAMILIES, NAMES, make_scheme, normalize_spec
from kvquant_jax.models.prefill_attention import prefill_attention
from kvquant_jax.models.testing import random_params, tiny_config
from kvquant_jax.models.w8a8 import W8A8Policy, quantize_params
from kvquant_jax.quant.ledger import measured_nbytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cache"))
from family_specs import SPECS as FAMILY_SPECS  # noqa: E402

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS host device count)")

B, H, D, C = 2, 8, 32, 48
# one spec per registered family (tests/cache/family_specs.py) plus the scale-axis variants whose layouts differ
SPECS = {**FAMILY_SPECS, "fp8": "fp8_e4m3:scales=warmup", "fp8_head": "fp8_e4m3:scales=warmup,axis=head",
         "static_int_head": "static_int4:axis=head"}


def _scheme(key):
    return make_scheme(SPECS[key], rope_theta=10000.0)


def test_specs_cover_every_family():
    assert {NAMES[normalize_spec(s)["name"]][0].family for s in SPECS.values()} == set(FAMILIES)


# ----------------------------------------------------------------------------------------------- mesh

def test_parse_mesh_and_errors():
    assert S.parse_mesh("data=2,model=4") == S.MeshShape(2, 4)
    assert S.parse_mesh("model=8") == S.MeshShape(1, 8)
    assert S.parse_mesh({"data": 8}) == S.MeshShape(8, 1)
    assert S.parse_mesh(None) is None
    for bad, what in [("data=2,modle=4", "unknown axis 'modle'"), ("data=0", "positive integer"),
                      ("data=2.5", "positive integer"), ("data=2,data=2", "given twice"), ("data", "axis=size"),
                      ("", "empty"), ({"model": True}, "positive integer")]:
        with pytest.raises(ValueError, match=what):
            S.parse_mesh(bad)
    with pytest.raises(ValueError, match="needs 16 devices, 8 available"):
        S.make_mesh("data=4,model=4")
    mesh = S.make_mesh("data=2,model=4")
    assert dict(mesh.shape) == {"data": 2, "model": 4}


def test_bad_mesh_names_the_sizes():
    with pytest.raises(ValueError, match="data=4 does not divide the batch of 6"):
        S.check_mesh(S.MeshShape(4, 1), batch=6)
    with pytest.raises(ValueError, match="model=2 does not divide the 3 KV heads"):
        S.check_mesh(S.MeshShape(1, 2), num_heads=6, num_kv_heads=3)
    with pytest.raises(ValueError, match="model=4 does not divide the 6 query heads"):
        S.check_mesh(S.MeshShape(1, 4), num_heads=6, num_kv_heads=2)
    S.check_mesh(S.MeshShape(1, 4), num_heads=8, num_kv_heads=2)          # Hkv < model: replicated, allowed
    cache = init_cache(_scheme("per_token"), num_layers=1, batch=3, capacity=C, num_kv_heads=H, head_dim=D)
    with pytest.raises(ValueError, match="data=2 does not divide the batch of 3"):
        S.place_cache(cache, S.make_mesh("data=2,model=4"))


# ----------------------------------------------------------------------------------------------- weights

def test_megatron_weight_specs_stacked_unstacked_and_w8a8():
    cfg = tiny_config(num_heads=8, num_kv_heads=4, hidden_size=64, intermediate_size=128, vocab_size=128,
                      tie_embeddings=False)
    params = random_params(cfg)
    specs = S.param_specs(params, cfg, S.MeshShape(2, 4))
    lay = specs["layers"]
    assert (lay["wq"], lay["wk"], lay["wv"]) == (P(None, None, "model"),) * 3       # column-parallel
    assert (lay["w_gate"], lay["w_up"]) == (P(None, None, "model"),) * 2
    assert (lay["wo"], lay["w_down"]) == (P(None, "model", None),) * 2              # row-parallel
    assert specs["embed"] == P("model", None) and specs["lm_head"] == P(None, "model")   # vocab
    assert lay["attn_norm"] == P() and specs["final_norm"] == P()
    one = S.param_specs({**params, "layers": tuple(jax.tree.map(lambda a: a[0], params["layers"]) for _ in
                                                   range(1))}, cfg, S.MeshShape(1, 4))["layers"][0]
    assert one["wq"] == P(None, "model") and one["wo"] == P("model", None)
    # Hkv < model: K/V projections replicated, query heads still split
    rep = S.param_specs(params, cfg, S.MeshShape(1, 8))["layers"]
    assert rep["wk"] == P() and rep["wq"] == P(None, None, "model")
    # W8A8 QuantLinear: codes [L, N, K], scale [L, N]
    qp = quantize_params(params, W8A8Policy())
    q = S.param_specs(qp, cfg, S.MeshShape(1, 4))["layers"]
    assert q["wq"].codes == P(None, "model", None) and q["wq"].scale == P(None, "model")
    assert q["wo"].codes == P(None, None, "model") and q["wo"].scale == P()
    with pytest.raises(ValueError, match="no rule for parameter 'mystery'"):
        S.param_spec("mystery", (4, 4), model=2, num_kv_heads=4)
    assert S.param_spec("layers/q_norm", (16,), model=2, num_kv_heads=4) == P()   # 1-D: replicated


# ----------------------------------------------------------------------------------------------- cache

def _filled(scheme, mesh, seed=0):
    rng = np.random.default_rng(seed)
    cache = init_cache(scheme, num_layers=1, batch=B, capacity=C, num_kv_heads=H, head_dim=D)
    p = getattr(scheme, "prefix_len", 0)
    if p:
        cache = cache.replace(lengths=cache.lengths + p)
    return S.place_cache(cache, mesh) if mesh is not None else cache


@pytest.mark.parametrize("key", sorted(SPECS))
def test_every_cache_field_has_its_spec_and_device_ledger_matches_shards(key):
    scheme = _scheme(key)
    mesh = S.make_mesh("data=2,model=4")
    cache = _filled(scheme, mesh)
    axes = scheme.field_axes(layer_state(cache, 0)[1])
    for name, ax in axes.items():
        arr = getattr(cache.groups[0], name)
        spec = tuple(arr.sharding.spec) + (None,) * (arr.ndim - len(arr.sharding.spec))
        want = (None,) + tuple({"batch": "data", "heads": "model"}.get(a) for a in ax)
        assert spec == want, (name, spec, want)
    # per-tensor scales replicated on every shard
    if key in ("fp8", "static_int"):
        assert cache.groups[0].k_scale.sharding.is_fully_replicated
    if key in ("fp8_head", "static_int_head"):
        assert cache.groups[0].k_scale.sharding.spec == P(None, "model")
    per_dev = S.addressable_bytes(cache)
    assert len(per_dev) == 8 and len(set(per_dev.values())) == 1
    led = S.device_ledger(cache, mesh)
    assert sum(led.values()) == next(iter(per_dev.values()))
    # sharded fields: exactly total / (data * model) per device
    total = measured_nbytes(cache)
    full = {f: getattr(cache.groups[0], f) for f, ax in axes.items() if "batch" in ax and "heads" in ax}
    for name, arr in full.items():
        assert arr.addressable_shards[0].data.nbytes * 8 == arr.nbytes, name
    if len(full) == len(axes):          # every field over both axes: the device holds total / (data x model)
        assert sum(led.values()) - 4 == (sum(total.values()) - cache.lengths.nbytes) // 8   # + its lengths [B/2]


def test_kv_heads_replicated_when_fewer_than_model():
    scheme = _scheme("per_token")
    cache = init_cache(scheme, num_layers=1, batch=B, capacity=C, num_kv_heads=2, head_dim=D)
    placed = S.place_cache(cache, S.make_mesh("data=2,model=4"))
    assert placed.groups[0].k_codes.sharding.spec == P(None, "data", None, None, None)
    assert S.device_ledger(placed, S.MeshShape(2, 4))["codes"] == measured_nbytes(cache)["codes"] // 2


# ----------------------------------------------------------------------------------------------- append

def _attn(scheme):
    def attn(q, k, v, view, lengths, num_new):
        if q.shape[1] == 1:
            return dispatch.decode_attention(q[:, 0], scheme, view, lengths, k[:, 0], v[:, 0],
                                             impl="reference")[:, None]
        return prefill_attention(q, k, v, num_new, scheme.materialize_layer(view, lengths), impl="reference")
    return attn


def _run_appends(keys, mesh, steps):
    """Prefill + decode appends of the same K/V through ``local_layer`` on ``mesh`` (None: unsharded) for every
    scheme of ``keys``, in ONE jitted function (one compilation per mesh)."""
    schemes = {key: _scheme(key) for key in keys}
    states, lengths = {}, {}
    for key, scheme in schemes.items():
        cache = _filled(scheme, mesh)
        st = layer_state(cache, 0)[1]
        if mesh is not None:
            st = S.map_specs(lambda a, s: S.place(a, jax.sharding.NamedSharding(mesh, s)), st,
                             S.layer_specs(scheme, st, model=int(mesh.shape["model"]), batch=B, num_kv_heads=H))
        states[key], lengths[key] = st, cache.lengths

    @jax.jit
    def run(states, lengths):
        out = {}
        for key, scheme in schemes.items():
            st, n0, outs = states[key], lengths[key], []
            for q, k, v, n in steps:
                st, ok, o = local_layer(_attn(scheme), scheme, q, k, v, st, n0, n)
                n0 = n0 + jnp.where(ok, n, 0)
                outs.append(o)
            out[key] = (st, n0, outs)
        return out

    with S.mesh_context(mesh):
        res = run(states, lengths)
    return {key: (jax.tree.map(np.asarray, st), np.asarray(n0), [np.asarray(o) for o in outs])
            for key, (st, n0, outs) in res.items()}


def _steps(seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for t in (11, 1):
        q = rng.normal(0, 1, (B, t, 2 * H, D)).astype(np.float32)
        k = (rng.normal(0, 1, (B, t, H, D)) * np.linspace(0.5, 3, H)[None, None, :, None]).astype(np.float32)
        v = rng.normal(0, 1, (B, t, H, D)).astype(np.float32)
        out.append((jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray([t, max(t - 3, 1)], jnp.int32)))
    return out


_CORE = ["fp8", "fp8_head", "kivi", "kvquant", "per_token", "qserve", "static_int"]   # per-token / per-head / KIVI / KVQuant / FP8
_MESHES = [("data=1,model=2", _CORE), ("data=1,model=4", _CORE), ("data=1,model=8", sorted(SPECS)),
           ("data=2,model=4", sorted(SPECS))]
_REF: dict = {}


@pytest.mark.slow
@pytest.mark.parametrize("mesh,keys", _MESHES, ids=[m for m, _ in _MESHES])
def test_codes_and_qparams_bit_identical_across_model_sizes(mesh, keys):
    """The same K/V appended (prefill of 11 rows, one decode row) unsharded (the oracle; it is model = 1) and on
    model in {2, 4, 8} (and data 2 x model 4): every stored field bit-identical (per-token / per-head / KIVI /
    KVQuant formats: nothing crosses a shard; FP8 per-tensor warm-up scales: reduced over every shard), lengths
    equal, the attention output equal to the unsharded one within 1e-6 relative.  Every family at 1 x 8 and
    2 x 4; the core formats at every model size."""
    steps = _steps()
    if not _REF:
        _REF.update(_run_appends(sorted(SPECS), None, steps))
    got = _run_appends(keys, S.make_mesh(mesh), steps)
    for key in keys:
        (rs, rn, ro), (gs, gn, go) = _REF[key], got[key]
        assert np.array_equal(rn, gn), key
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(rs), jax.tree.leaves(gs)):
            assert np.array_equal(a, b, equal_nan=True), (key, jax.tree_util.keystr(path))
        for a, b in zip(ro, go):
            np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6 * np.abs(a).max(), err_msg=key)
