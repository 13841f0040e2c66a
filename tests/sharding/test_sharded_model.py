"""Sharded == unsharded on the model: with the fixed-order numerics (``model.reduction: fixed_order``) greedy
tokens (32 steps), serving-path NLL and every teacher-forced log-probability are BIT-IDENTICAL on a tiny random
model with 8 KV heads (model in {1, 2, 4, 8}, DP x TP in {2x4, 8x1}: bf16, int4, KIVI-2, a mixed policy); with the
default numerics equal up to float rounding (SmolLM2 at TP 3 x DP 2: test_sharded_smollm2.py).  Also: the serving loop on a mesh,
KV heads replicated when Hkv < model, the compiled decode step free of cache collectives, bad meshes.  The
unsharded run on one device is the oracle.  CPU, 8 host devices (tests/conftest.py)."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax import sharding as S
from kvquant_jax.cache.interface import init_cache
from kvquant_jax.cache.registry import make_policy, make_scheme
from kvquant_jax.models.fixed_order import apply_numerics
from kvquant_jax.models.testing import random_params, tiny_config
from kvquant_jax.serving.generate import decode_loop, generate
from kvquant_jax.serving.inspect import hlo_shape
from kvquant_jax.serving.sampling import SamplingParams
from sharded_cases import KIVI2, N, run_decode

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS host device count)")

CFG = tiny_config(vocab_size=128, num_heads=8, num_kv_heads=8, hidden_size=64, intermediate_size=128, num_layers=2,
                  head_dim=32)
POLICIES = {
    "bf16": "bf16",
    "int4": "int4",
    "kivi2": KIVI2,
    "mixed": {"name": "int4", "full_precision_first": 1},      # layer 0 fp32, layer 1 int4
}
MESHES = ("data=1,model=8", "data=2,model=4", "data=8,model=1")
# int4 also at model = 2 and 4: the TP sweep {1, 2, 4, 8} of issue 18 (the other policies at 8: 1 x 8)
TP_SWEEP = {"int4": ("data=1,model=2", "data=1,model=4")}


def _policy(key, cfg=CFG):
    return make_policy(POLICIES[key], cfg.num_layers, rope_theta=cfg.rope_theta)


@pytest.fixture(scope="module")
def tiny():
    rng = np.random.default_rng(0)
    params = random_params(CFG, seed=1)
    prompt = rng.integers(3, CFG.vocab_size, (8, 12)).astype(np.int32)
    targets = rng.integers(3, CFG.vocab_size, (8, N + 1)).astype(np.int32)
    return params, prompt, targets


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(POLICIES))
def test_fixed_order_greedy_nll_and_logprobs_bit_identical(tiny, key):
    """Fixed-order numerics: 32 greedy tokens, the serving-path NLL and every teacher-forced log-probability (all
    32 steps x 8 sequences x 128 vocabulary entries) of each mesh equal the single-device run exactly."""
    params, prompt, targets = tiny
    cfg = apply_numerics(CFG, "fixed_order")
    policy = _policy(key)
    ref_tok, ref_nll, ref_lp = run_decode(cfg, params, policy, None, prompt, targets, logprobs=True)
    assert len(np.unique(ref_tok)) > 4                                    # a non-degenerate continuation
    for mesh in MESHES + TP_SWEEP.get(key, ()):
        tok, nll, lp = run_decode(cfg, params, policy, S.make_mesh(mesh), prompt, targets, logprobs=True)
        np.testing.assert_array_equal(tok, ref_tok, err_msg=mesh)
        np.testing.assert_array_equal(nll, ref_nll, err_msg=mesh)
        np.testing.assert_array_equal(lp, ref_lp, err_msg=mesh)


def test_serving_loop_on_a_mesh_keeps_the_cache_sharded(tiny):
    params, prompt, _ = tiny
    prompts = [list(map(int, prompt[i, : 4 + i])) for i in range(4)]             # ragged
    scheme = make_scheme("int4", rope_theta=CFG.rope_theta)
    ref = generate(params, CFG, prompts, max_new_tokens=24, scheme=scheme, eos_id=-1)
    mesh = S.make_mesh("data=2,model=4")
    with S.mesh_context(mesh):
        res = generate(S.place_params(params, CFG, mesh), CFG, prompts, max_new_tokens=24, scheme=scheme, eos_id=-1)
    assert res.tokens == ref.tokens
    codes = res.cache.groups[0].k_codes
    assert tuple(codes.sharding.spec)[:3] == (None, "data", "model") and codes.sharding.spec[3:] in ((), (None,) * 2)
    per_dev = S.addressable_bytes(res.cache)
    assert set(per_dev.values()) == {sum(S.device_ledger(res.cache, mesh).values())}
    assert codes.addressable_shards[0].data.nbytes * 8 == codes.nbytes    # total / (data x model)


def test_kv_heads_replicated_when_fewer_than_model_shards():
    cfg = tiny_config(vocab_size=128, num_heads=8, num_kv_heads=2, hidden_size=64, intermediate_size=128,
                      num_layers=2, head_dim=32)
    params = random_params(cfg, seed=2)
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, 128, (2, 8)).astype(np.int32)
    targets = rng.integers(3, 128, (2, N + 1)).astype(np.int32)
    policy = make_policy("int4", 2, rope_theta=cfg.rope_theta)
    assert S.param_specs(params, cfg, S.MeshShape(2, 4))["layers"]["wk"] == jax.sharding.PartitionSpec()
    ref_tok, ref_nll, _ = run_decode(cfg, params, policy, None, prompt, targets)
    tok, nll, _ = run_decode(cfg, params, policy, S.make_mesh("data=2,model=4"), prompt, targets)
    np.testing.assert_array_equal(tok, ref_tok)
    assert np.abs(nll - ref_nll).max() <= 1e-4 * np.abs(ref_nll).max()


def _collectives(hlo: str) -> list[tuple[str, list[str]]]:
    """(op, every array type on the line) of each cross-device collective in a compiled HLO module."""
    out = []
    for line in hlo.splitlines():
        m = re.search(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?\(", line)
        if m and "=" in line:
            out.append((m.group(1), re.findall(r"\b(?:pred|[suf]\d+|bf16|f8e\w+)\[[\d,]*\]", line)))
    return out


def _cache_types(cache, mesh) -> set[str]:
    """HLO types of every cache buffer: global, per-device, and gathered over one axis only."""
    d, m = int(mesh.shape["data"]), int(mesh.shape["model"])
    specs = S.cache_specs(cache, mesh)
    out = set()
    leaves = jax.tree.leaves(cache.groups)
    spec_leaves = jax.tree.leaves(specs.groups, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    for a, spec in zip(leaves, spec_leaves):
        for sizes in ({"data": d, "model": m}, {"data": d, "model": 1}, {"data": 1, "model": m},
                      {"data": 1, "model": 1}):
            shape = S._local_shape(a.shape, spec, sizes)
            out.add(hlo_shape(jax.ShapeDtypeStruct(shape, a.dtype)))
    return out


@pytest.mark.parametrize("spec", ["int4", KIVI2, "fp8_e4m3:scales=warmup"])
def test_compiled_decode_step_has_no_collective_on_cache_buffers(spec):
    """The compiled decode loop on a 2 x 4 mesh: its collectives are the math's (o / down all-reduces, vocab
    embedding and argmax, the ok flags); none moves a cache buffer (global, per-device or half-gathered type)."""
    mesh = S.make_mesh("data=2,model=4")
    scheme = make_scheme(spec, rope_theta=CFG.rope_theta)
    cache = S.place_cache(init_cache(scheme, num_layers=2, batch=4, capacity=96, num_kv_heads=8, head_dim=32), mesh)
    params = S.place_params(random_params(CFG), CFG, mesh)
    with S.mesh_context(mesh):
        hlo = decode_loop.lower(params, CFG, jnp.zeros((4,), jnp.int32), cache, jax.random.PRNGKey(0), max_new=4,
                                sampling=SamplingParams(), eos_id=2).compile().as_text()
    coll = _collectives(hlo)
    assert any(op == "all-reduce" for op, _ in coll)                      # the row-parallel reductions are there
    types = _cache_types(cache, mesh) - {"s32[4]", "s32[2]", "pred[4]", "pred[2]"}   # lengths-sized flags
    bad = [(op, t) for op, ts in coll for t in ts if t in types]
    assert not bad, bad


def test_bad_mesh_refused_before_anything_runs(tiny):
    params, prompt, _ = tiny
    mesh = S.make_mesh("data=2,model=4")
    with S.mesh_context(mesh), pytest.raises(ValueError, match="data=2 does not divide the batch of 3"):
        generate(params, CFG, [[5, 6], [7], [8, 9, 10]], max_new_tokens=4)
    cfg = tiny_config(num_heads=6, num_kv_heads=3)
    with pytest.raises(ValueError, match="model=2 does not divide the 3 KV heads"):
        S.place_params(random_params(cfg), cfg, S.make_mesh("data=1,model=2"))


@pytest.mark.parametrize("spec", ["bf16", "int4"])
def test_one_by_one_mesh_decode_step_stays_in_place(spec):
    """The sharded code path on a 1 x 1 mesh (what the single-H200 overhead benchmark measures) keeps the serving
    layout's in-place decode step: every cache buffer aliased input -> output, no copy of a code / K-V buffer
    (the [.., C, 1] per-token scale re-layout of XLA:CPU aside, as in tests/serving/test_serving_layout.py)."""
    from kvquant_jax.models.llama import forward, unstack_layers
    from kvquant_jax.serving.inspect import aliased_parameters, cache_buffer_copies

    cfg = tiny_config(num_layers=2, num_heads=8, num_kv_heads=4, head_dim=32, hidden_size=64, intermediate_size=128,
                      vocab_size=128)
    mesh = S.make_mesh("data=1,model=1")
    with S.mesh_context(mesh):
        params = S.params_on_current_mesh(unstack_layers(random_params(cfg, dtype="bf16")), cfg)
        cache = S.on_current_mesh(init_cache(make_scheme(spec), num_layers=2, batch=2, capacity=512, num_kv_heads=4,
                                             head_dim=32, layer_groups="per_layer"))
        step = jax.jit(lambda p, t, c: forward(p, cfg, t, c, attention_impl="auto"), donate_argnums=2)
        hlo = step.lower(params, jnp.zeros((2, 1), jnp.int32), cache).compile().as_text()
    assert not [c for c in cache_buffer_copies(hlo, cache) if not c[1].endswith(",1]")]
    assert aliased_parameters(hlo) >= len(jax.tree.leaves(cache.groups))
