"""The paged-direct forward (attention/paged.PagedStep) against the gather -> forward -> scatter path.

* Every registry family that pages (tests/cache/family_specs.py; the window ring is refused by the paged layout):
  one layer's append + attention through ``PagedStep.layer_step`` (window append through the written pages, or
  the view of the mapped pages) equals the whole-view path bit for bit -- every pool page but the trash page,
  every per-sequence and shared field and ``ok`` -- on a random ragged history, for a prefill chunk and a decode
  step; the attention output (over the view of the mapped pages instead of the whole view) agrees to 1e-6.  A
  window shifted by one page must differ (the comparison has teeth).
* The decode step through the paged Pallas kernel (interpreted) agrees with the reference to 1e-4.
* The compiled engine step's temporary memory does not grow with ``max_pages`` (the view path's does).
"""
from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.attention import paged as pa
from kvquant_jax.cache import paged
from kvquant_jax.cache.registry import make_scheme
from kvquant_jax.models.prefill_attention import attend
from kvquant_jax.models.testing import random_params, tiny_config
from kvquant_jax.serving import engine as eng

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cache"))
from family_specs import SPECS  # noqa: E402

B, H, HQ, D = 3, 2, 4, 16
PAGE, MAX_PAGES, NUM_PAGES = 8, 6, 20
FAMILIES = sorted(f for f in SPECS if f != "window")      # the paged layout refuses window rings
def _rows(rng, t, heads=H):
    return jnp.asarray(rng.standard_normal((B, t, heads, D)), jnp.float32)


def _attn(scheme):
    def attn(q, k, v, view, lengths, num_new):
        return attend(q, k, v, num_new, scheme.materialize_layer(view, lengths))
    return attn


def _view_layer(cache, write, q, k, v, num):
    """The whole-view path of one layer (what the engine's ``forward="view"`` step does per layer); ``q`` None:
    append only."""
    scheme = cache.schemes[0][0]
    view = paged.gather(cache)
    st = jax.tree.map(lambda a: a[0], view.groups[0])
    st2, ok = scheme.append_layer_with_status(st, cache.lengths, k, v, num)
    read = st2 if scheme.append_keeps_old_view(k.shape[1]) else st
    out = None if q is None else _attn(scheme)(q, k, v, read, cache.lengths, num)
    new = paged.scatter(cache, view.replace(groups=(jax.tree.map(lambda a: a[None], st2),)), write)
    return out, new, ok


def _direct_layer(cache, write, first, q, k, v, num, *, view_pages, window_pages, decode_impl="reference"):
    step = pa.paged_step(cache, write, first, view_pages=view_pages, window_pages=window_pages)
    gst, ok, out = step.layer_step(0, step.groups[0], 0, _attn(cache.schemes[0][0]), q, k, v, num,
                                   decode_impl=decode_impl)
    return out, step.replace(groups=(gst,)).paged(), ok


def _assert_same_cache(got, want):
    for f in got.layouts[0]:
        a, b = getattr(got.groups[0], f.name), getattr(want.groups[0], f.name)
        if f.kind == paged.PAGED:                         # the trash page absorbs masked writes: not compared
            a, b = a[:, :NUM_PAGES], b[:, :NUM_PAGES]
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f.name)


def _plan(spec, steps, seed=0):
    """A cache with every page of the whole scenario mapped (host-side ``paged.reserve`` per step: the page table
    does not depend on the appended values), and per step ``(T, num, write, first, window, view)``."""
    scheme = make_scheme(spec)
    cache, pool = paged.init_paged(scheme, num_layers=1, batch=B, num_pages=NUM_PAGES, page_size=PAGE,
                                   max_pages=MAX_PAGES, num_kv_heads=H, head_dim=D)
    start = np.asarray(cache.lengths).astype(np.int64)
    old, plan = start, []
    for t, num in steps:
        new = old + np.asarray(num)
        cache, pool, write = paged.reserve(cache.replace(lengths=jnp.asarray(old, jnp.int32)), pool, new)
        first, win, view = paged.step_pages(cache, old, new)
        plan.append((t, jnp.asarray(num, jnp.int32), jnp.asarray(write), jnp.asarray(first, jnp.int32),
                     eng.bucket(win, MAX_PAGES), eng.bucket(view, MAX_PAGES)))
        old = new
    rng = np.random.default_rng(seed)
    qkv = [(_rows(rng, t, HQ), _rows(rng, t), _rows(rng, t)) for t, _ in steps]
    return scheme, cache.replace(lengths=jnp.asarray(start, jnp.int32)), plan, qkv


HISTORY = ((17, (17, 12, 5)),)                           # ragged lengths: three page phases
STEPS = ((6, (6, 2, 0)), (1, (1, 1, 1)))                 # a ragged prefill chunk (one idle slot), a decode step


TEETH = ("per_token", "kivi")            # the shifted default and a position-dependent override (rings, frontiers)


def _scenario(spec, *, steps=STEPS, decode_impl="reference", teeth=False, seed=0):
    """History appended through the whole-view path, then every step of ``steps`` through both paths (and with
    ``teeth``, for a prefill step, the direct path with its window one page late).  One compile."""
    scheme, cache, plan, qkv = _plan(spec, HISTORY + steps, seed)

    @jax.jit
    def run(cache, plan_arrays, qkv):
        results = []
        for i, ((t, _, _, _, win, view), (num, write, first), (q, k, v)) in enumerate(zip(plan, plan_arrays, qkv)):
            if i < len(HISTORY):
                ref = _view_layer(cache, write, None, k, v, num)
            else:
                ref = _view_layer(cache, write, q, k, v, num)
                kw = dict(view_pages=view, window_pages=win, decode_impl=decode_impl)
                r = {"view": ref, "direct": _direct_layer(cache, write, first, q, k, v, num, **kw)}
                if teeth and t > 1:
                    r["late"] = _direct_layer(cache, write, first + 1, q, k, v, num, **kw)
                results.append(r)
            cache = ref[1].replace(lengths=ref[1].lengths + num)
        return results

    return scheme, run(cache, [(n, w, f) for _, n, w, f, _, _ in plan], qkv)


@pytest.mark.parametrize("family", FAMILIES)
def test_direct_layer_equals_view_path_bit_for_bit(family):
    scheme, results = _scenario(SPECS[family], teeth=family in TEETH)
    for (t, _), r in zip(STEPS, results):
        want_out, want, want_ok = r["view"]
        got_out, got, got_ok = r["direct"]
        _assert_same_cache(got, want)
        np.testing.assert_array_equal(np.asarray(got_ok), np.asarray(want_ok))
        # the view of the mapped pages has fewer (masked) rows than the whole view: reductions may round apart
        np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), rtol=1e-6, atol=1e-6)
        path = "window" if scheme.supports_window_append() else "view"
        assert pa.PATHS[(scheme.family, "append", "decode" if t == 1 else "prefill")] == path
        if "late" in r:                                  # teeth: a window one page late misses rows it must write
            with pytest.raises(AssertionError):
                _assert_same_cache(r["late"][1], want)
    assert ("late" in results[0]) == (family in TEETH)
    if family in ("full", "per_token", "fp8", "kivi", "kvquant", "prefix"):
        assert scheme.supports_window_append(), "the benchmarked and position-dependent families append in a window"


def test_direct_decode_through_paged_kernel():
    """T == 1 with decode_impl="kernel": the paged Pallas kernel (interpreted) reads the INT4 pools in place
    through the page table (KIVI's ring as a small region: tests/kernels/test_paged_decode_attention.py)."""
    scheme, results = _scenario(SPECS["per_token"], steps=STEPS[1:], decode_impl="kernel", seed=1)
    assert pa.PATHS[(scheme.family, "attention", "decode")] == "paged_kernel"
    want_out, want, _ = results[0]["view"]
    got_out, got, _ = results[0]["direct"]
    _assert_same_cache(got, want)
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), rtol=1e-4, atol=1e-4)


CFG = tiny_config(num_layers=1, max_position=4096)
PARAMS = random_params(CFG, seed=0)


def _temp_bytes(forward: str, max_pages: int) -> int:
    """Temporary bytes of the compiled engine step (4 slots, a prefill chunk of 8, 4 view pages) at ``max_pages``."""
    scheme = make_scheme("int4", rope_theta=CFG.rope_theta)
    s, page, chunk = 4, 8, 8
    cache, _ = paged.init_paged(scheme, num_layers=CFG.num_layers, batch=s, num_pages=64, page_size=page,
                                max_pages=max_pages, num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim)
    toks = jnp.zeros((s, chunk), jnp.int32)
    num = jnp.full((s,), chunk, jnp.int32)
    write = jnp.zeros((s, max_pages), jnp.bool_)
    samp = (jnp.zeros(s, jnp.float32), jnp.zeros(s, jnp.int32), jnp.ones(s, jnp.float32), jax.random.PRNGKey(0),
            jnp.zeros(s, jnp.int32), jnp.zeros(s, jnp.int32))
    if forward == "direct":
        lowered = eng._step_direct.lower(PARAMS, CFG, cache, jnp.arange(s, dtype=jnp.int32), toks, num, write,
                                         jnp.zeros(s, jnp.int32), *samp, attention_impl="reference", view_pages=4,
                                         window_pages=2)
    else:
        lowered = eng._step_view.lower(PARAMS, CFG, cache, toks, num, write, *samp, attention_impl="reference")
    return int(lowered.compile().memory_analysis().temp_size_in_bytes)


def test_compiled_step_memory_does_not_scale_with_max_pages():
    small, large = _temp_bytes("direct", 8), _temp_bytes("direct", 256)
    assert large <= small * 1.05 + 4096, (small, large)
    view_large = _temp_bytes("view", 256)
    assert view_large > 4 * large, (view_large, large)   # teeth: the whole-view step does grow with max_pages
