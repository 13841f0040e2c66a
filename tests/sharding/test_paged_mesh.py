"""The paged cache on a ``(data=1, model)`` mesh: tensor parallel over KV heads (sharding.paged_cache_specs).

* One paged-direct layer step (``attention.paged.PagedStep.layer_step``) on meshes model = 2, 4 (KV heads split)
  and 8 (> Hkv: heads replicated) stores exactly what the unsharded step stores -- every pool page but the trash
  page, every per-sequence and shared field and ``ok`` BIT FOR BIT -- over three steps (a ragged prefill from
  empty, a second chunk, a decode step) for bf16, INT8 per token, KIVI-2 and FP8 with per-tensor warm-up scales
  (max over every head of every shard: ``cache.shards.shard_max``); the attention output agrees to float32
  rounding (<= 5e-7 x max|out|; bit for bit at model = 8).
* The engine on model = 2 produces the unsharded engine's greedy tokens on a seeded trace with preemptions and
  prefix hits, keeps the pools' heads split, and compiles each step shape once; its compiled decode step (model = 4)
  holds no collective on a pool buffer; ``kvq serve-bench --mesh model=2`` runs.
* A mesh that does not fit (data > 1; a model axis that does not divide the heads) is refused naming the sizes,
  before the cache changes.
CPU, 8 host devices (tests/conftest.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax import sharding as S
from kvquant_jax.attention import paged as pa
from kvquant_jax.cache import paged
from kvquant_jax.cache.registry import make_scheme
from kvquant_jax.models.prefill_attention import attend
from kvquant_jax.models.testing import random_params, tiny_config
from kvquant_jax.serving import engine as eng
from kvquant_jax.serving.inspect import hlo_shape

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS host device count)")

B, HKV, HQ, D = 3, 4, 8, 16
PAGE, MAX_PAGES, NUM_PAGES = 8, 4, 16
SCHEMES = {"bf16": "bf16", "int8": "int8", "kivi2": "kivi2:group_size=8,v_group_size=8,residual=8",
           "fp8": "fp8_e4m3:scales=warmup,axis=tensor"}
# model = 2 for every scheme; 4 (one KV head per device) and 8 (> Hkv: heads replicated) on the per-tensor FP8
# max, the one cross-head reduction (CPU time)
MESHES = {"bf16": ("model=2",), "int8": ("model=2",), "kivi2": ("model=2",),
          "fp8": ("model=2", "model=4", "model=8")}
STEPS = ((12, (12, 7, 0)), (8, (8, 8, 5)), (1, (1, 1, 1)))      # (T, num_new): from empty, ragged, an idle slot


def _steps(scheme):
    """An empty paged cache and per step ``(T, num, write, first, window pages, view pages)`` (host planning:
    ``paged.reserve`` maps the pages of every step up front; the page table does not depend on the values)."""
    cache, pool = paged.init_paged(scheme, num_layers=1, batch=B, num_pages=NUM_PAGES, page_size=PAGE,
                                   max_pages=MAX_PAGES, num_kv_heads=HKV, head_dim=D)
    lengths, plan = np.asarray(cache.lengths).astype(np.int64), []
    table = cache
    for t, num in STEPS:
        new = lengths + np.asarray(num)
        table, pool, write = paged.reserve(table.replace(lengths=jnp.asarray(lengths, jnp.int32)), pool, new)
        first, win, view = paged.step_pages(table, lengths, new)
        plan.append((t, np.asarray(num, np.int32), write, first.astype(np.int32), eng.bucket(win, MAX_PAGES),
                     eng.bucket(view, MAX_PAGES)))
        lengths = new
    return cache.replace(page_table=table.page_table), plan


def _run_steps(spec, mesh):
    """(caches after each step, ok per step, outputs per step) of the layer steps of :data:`STEPS` (one jit),
    on ``mesh`` (None: unsharded)."""
    scheme = make_scheme(spec)
    cache, plan = _steps(scheme)
    rng = np.random.default_rng(0)
    qkv = [tuple(jnp.asarray(rng.standard_normal((B, t, h, D)), jnp.float32) for h in (HQ, HKV, HKV))
           for t, _ in STEPS]

    def attn(q, k, v, view, lengths, num_new):
        return attend(q, k, v, num_new, scheme.materialize_layer(view, lengths))

    @jax.jit
    def run(cache, arrays, qkv):
        caches, oks, outs = [], [], []
        for (_, _, _, _, win, view), (num, write, first), (q, k, v) in zip(plan, arrays, qkv):
            step = pa.paged_step(cache, write, first, view_pages=view, window_pages=win)
            gst, ok, out = step.layer_step(0, step.groups[0], 0, attn, q, k, v, num, decode_impl="reference")
            cache = step.replace(groups=(gst,), lengths=step.lengths + num).paged()
            caches.append(cache)
            oks.append(ok)
            outs.append(out)
        return caches, oks, outs

    arrays = [(jnp.asarray(n), jnp.asarray(w), jnp.asarray(f)) for _, n, w, f, _, _ in plan]
    with S.mesh_context(mesh):
        if mesh is not None:
            cache = S.place_cache(cache, mesh)
        return jax.device_get(run(cache, arrays, qkv))


def _fields(cache):
    """``{name: array}`` of the layer group, pools without the trash page (it absorbs masked writes in any order)."""
    out = {}
    for f in cache.layouts[0]:
        a = np.asarray(getattr(cache.groups[0], f.name))
        out[f.name] = a[:, :NUM_PAGES] if f.kind == paged.PAGED else a
    return out


@functools.lru_cache(maxsize=None)
def _unsharded(key):
    return _run_steps(SCHEMES[key], None)


@pytest.mark.parametrize("key, mesh", [(k, m) for k in sorted(SCHEMES) for m in MESHES[k]])
def test_layer_step_on_a_mesh_equals_unsharded_bit_for_bit(key, mesh):
    want_caches, want_ok, want_out = _unsharded(key)
    got_caches, got_ok, got_out = _run_steps(SCHEMES[key], S.make_mesh(mesh))
    for i, (gc, wc) in enumerate(zip(got_caches, want_caches)):
        want = _fields(wc)
        for name, a in _fields(gc).items():
            np.testing.assert_array_equal(a, want[name], err_msg=f"{key} {mesh} step {i}: {name}")
        np.testing.assert_array_equal(got_ok[i], want_ok[i])
        # the attention output: float32 rounding only (XLA:CPU tiles the per-device [B, T, Hq / model] einsums
        # differently; measured <= 1.2e-7 x max|out|, 0 at model=8 where every device computes every head)
        err = np.abs(np.asarray(got_out[i]) - np.asarray(want_out[i])).max()
        assert err <= 5e-7 * np.abs(np.asarray(want_out[i])).max(), f"{key} {mesh} step {i}: attention output {err}"
        if mesh == "model=8":
            np.testing.assert_array_equal(got_out[i], want_out[i])
    # teeth: every step appended rows (the stored fields change), attended them (outputs differ per head group),
    # and the last step reads the whole history
    assert all(bool(np.all(ok)) for ok in want_ok)
    for a, b in zip(want_caches, want_caches[1:]):
        assert any(not np.array_equal(x, y) for x, y in zip(_fields(a).values(), _fields(b).values()))
    out = np.asarray(want_out[-1])
    assert np.abs(out).max() > 0.1 and not np.allclose(out[:, :, : HQ // 2], out[:, :, HQ // 2:])
    if key == "fp8":                  # the warm-up set one per-tensor scale (replicated over the heads), not 1
        scale = _fields(want_caches[0])["k_scale"]
        assert np.all(scale == scale.reshape(-1)[0]) and scale.reshape(-1)[0] != 1


CFG = tiny_config(vocab_size=128, num_heads=HQ, num_kv_heads=HKV, hidden_size=64, intermediate_size=128,
                  num_layers=2, head_dim=D, max_position=128)
PARAMS = dict(random_params(CFG, seed=0))
PARAMS["embed"] = PARAMS["embed"] * 0.2          # small embeddings: diverse greedy continuations
ENGINE = eng.EngineConfig(num_slots=3, page_size=8, num_pages=8, max_pages=8, chunk=8, view_buckets=1)


def test_engine_on_a_mesh_equals_the_unsharded_engine():
    reqs = eng.synthetic_trace(6, rate=0, prompt_range=(3, 30), output_range=(8, 20), vocab_size=CFG.vocab_size,
                               seed=1, shared_prefix=8)
    scheme = make_scheme("int8", rope_theta=CFG.rope_theta)
    want = eng.Engine(PARAMS, CFG, scheme, ENGINE).run(reqs)
    compiled = eng._step_direct._cache_size()
    mesh = S.make_mesh("model=2")
    e = eng.Engine(PARAMS, CFG, scheme, ENGINE, mesh=mesh)
    got = e.run(reqs)
    for r in reqs:
        assert got[r.id].tokens == want[r.id].tokens, f"request {r.id}"
    assert len({t for r in want.values() for t in r.tokens}) >= 10, "degenerate outputs make a weak comparison"
    assert sum(r.preemptions for r in got.values()) > 0 and sum(r.prefix_hit_tokens for r in got.values()) > 0
    assert eng._step_direct._cache_size() - compiled == len(e.step_shapes)      # one compile per step shape
    codes = e.cache.groups[0].k_codes                                            # [L, pages + 1, Hkv, rows, D]
    assert codes.sharding.mesh.shape == mesh.shape and tuple(codes.sharding.spec)[:3] == (None, None, "model")
    assert codes.addressable_shards[0].data.nbytes * 2 == codes.nbytes
    paged.validate(e.cache, e.pool, e.prefixes.references())


def test_mesh_that_does_not_fit_is_refused_and_the_cache_is_unchanged():
    with pytest.raises(ValueError, match=r"mesh model=3 does not divide the 8 query heads"):
        eng.Engine(PARAMS, CFG, None, ENGINE, mesh=S.make_mesh("model=3"))
    with pytest.raises(ValueError, match=r"data=2,model=2: the page pools are one address space.*use data=1"):
        eng.Engine(PARAMS, CFG, None, ENGINE, mesh=S.make_mesh("data=2,model=2"))
    # a layer step traced under a bad mesh raises before anything runs: the cache it was given is intact
    scheme = make_scheme("int8")
    cache, plan = _steps(scheme)
    before = jax.tree.map(np.asarray, cache)
    t, num, write, first, win, view = plan[0]
    step = pa.paged_step(cache, write, first, view_pages=view, window_pages=win)
    q, k = jnp.ones((B, t, HQ, D), jnp.float32), jnp.ones((B, t, HKV, D), jnp.float32)
    with S.mesh_context(S.make_mesh("model=3")), pytest.raises(ValueError, match="model=3 does not divide the 8 query"):
        jax.jit(lambda s: s.layer_step(0, s.groups[0], 0, None, q, k, k, jnp.asarray(num),
                                       decode_impl="reference"))(step)
    with pytest.raises(ValueError, match="model=3 does not divide the 4 KV heads"):
        S.place_cache(cache, S.make_mesh("model=3"))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, cache), before)


def test_compiled_decode_step_moves_no_page():
    """The engine's compiled decode step on model = 4 (INT4 pools): its collectives are the math's (row-parallel
    all-reduces, small activation re-layouts, the ok flags); none carries a pool or per-sequence field, global or
    per device (each device appends to and reads its own heads of the pages)."""
    from test_sharded_model import _collectives

    mesh, s = S.make_mesh("model=4"), 4
    cache, _ = paged.init_paged(make_scheme("int4", rope_theta=CFG.rope_theta), num_layers=CFG.num_layers, batch=s,
                                num_pages=32, page_size=8, max_pages=8, num_kv_heads=HKV, head_dim=D)
    cache = S.place_cache(cache, mesh)
    samp = (jnp.zeros(s, jnp.float32), jnp.zeros(s, jnp.int32), jnp.ones(s, jnp.float32), jax.random.PRNGKey(0),
            jnp.zeros(s, jnp.int32), jnp.zeros(s, jnp.int32))
    with S.mesh_context(mesh):
        hlo = eng._step_direct.lower(S.place_params(PARAMS, CFG, mesh), CFG, cache, jnp.arange(s, dtype=jnp.int32),
                                     jnp.zeros((s, 1), jnp.int32), jnp.ones(s, jnp.int32),
                                     jnp.zeros((s, 8), jnp.bool_), jnp.zeros(s, jnp.int32), *samp,
                                     attention_impl="reference", view_pages=4, window_pages=2).compile().as_text()
    coll = _collectives(hlo)
    assert any(op == "all-reduce" for op, _ in coll)                  # the row-parallel reductions are there
    pools = set()
    for a in jax.tree.leaves(cache.groups):                          # [L, pages + 1, Hkv, rows, ...]
        for heads in (HKV, HKV // 4):                                # global and per-device shapes
            sh = a.shape[:2] + (heads,) + a.shape[3:]
            pools |= {hlo_shape(jax.ShapeDtypeStruct(x, a.dtype)) for x in (sh, sh[1:])}
    bad = [(op, t) for op, ts in coll for t in ts if t in pools]
    assert not bad, bad


def test_kvq_serve_bench_on_a_mesh(capsys):
    import json

    from kvquant_jax.cli import main

    args = ["serve-bench", "--model", "tiny", "--cache", "int4", "--synthetic", "2", "--rate", "50", "--prompt-len",
            "8", "12", "--output-len", "3", "3", "--slots", "2", "--page-size", "8", "--num-pages", "8", "--chunk",
            "8", "--view-buckets", "1", "--no-realtime"]
    assert main(args + ["--mesh", "model=2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["mesh"] == "data=1,model=2" and out["output_tokens"] == 6
    assert main(args + ["--mesh", "data=2"]) == 2
    assert "the page pools are one address space" in capsys.readouterr().err


def test_serve_bench_hbm_budget_is_per_device(capsys):
    """``--hbm-gb`` is one device's KV budget: a mesh that splits the KV heads over model=2 holds each page half
    on each device, so the same budget sizes a pool of twice the pages; without a mesh exactly the pages that fit."""
    import json

    from kvquant_jax.cli import main
    from kvquant_jax.serving.engine_cli import page_bytes

    cfg = tiny_config(max_position=4096)
    assert cfg.num_kv_heads % 2 == 0
    budget_gib = 6.25 * page_bytes(make_scheme("int4"), cfg, 8) / 2**30          # 6 whole pages on one device
    args = ["serve-bench", "--model", "tiny", "--cache", "int4", "--synthetic", "1", "--rate", "50", "--prompt-len",
            "8", "8", "--output-len", "2", "2", "--slots", "1", "--page-size", "8", "--hbm-gb", repr(budget_gib),
            "--chunk", "8", "--view-buckets", "1", "--no-realtime"]
    pages = []
    for extra in ([], ["--mesh", "model=2"]):
        assert main(args + extra) == 0
        pages.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["num_pages"])
    assert pages == [6, 12]
