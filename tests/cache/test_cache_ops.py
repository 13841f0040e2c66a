"""Deterministic state-operation tests for every scheme: append vs the NumPy shadow, atomic rejection, truncate ==
fresh build, fork/reorder, donation without copies."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.cache import ops
from kvquant_jax.cache.fp8 import FP8Scheme, load_scales
from kvquant_jax.cache.kivi import KIVIScheme

from cache_helpers import B, CASES, D, H, L, T_PREFILL, assert_matches_shadow, new_cache, physical, rows, \
    jax_tree_index
from cache_shadow import ShadowCache, needs_rows_spec

CASE_IDS = sorted(CASES)


def _pad(pairs, t):
    """Pad per-layer rows to the static prefill width (padding rows are garbage on purpose)."""
    out = []
    for k, v in pairs:
        if k.shape[1] == t:
            out.append((k, v))
            continue
        pad = [(0, 0), (0, t - k.shape[1]), (0, 0), (0, 0)]
        out.append((np.pad(k, pad, constant_values=np.nan), np.pad(v, pad, constant_values=np.nan)))
    return tuple(out)


def _append(cache, shadow, pairs, num_new):
    t = pairs[0][0].shape[1]
    padded = _pad(pairs, T_PREFILL) if 1 < t < T_PREFILL else pairs
    out = ops.append(cache, padded, np.asarray(num_new))
    shadow.append(pairs, np.asarray(num_new))
    return out


def _build(policy, rng, steps, kind="mixed"):
    cache, shadow = new_cache(policy), ShadowCache(policy, B, H, D)
    for n in steps:
        if isinstance(n, int):
            cache = _append(cache, shadow, rows(rng, 1, kind), np.full(B, n))
        else:
            cache = _append(cache, shadow, rows(rng, T_PREFILL, kind), np.asarray(n))
    return cache, shadow


@pytest.mark.parametrize("case", CASE_IDS)
def test_prefill_then_decode_matches_shadow(case):
    rng = np.random.default_rng(1)
    policy = CASES[case]
    cache, shadow = _build(policy, rng, [(5, 3, 0)])
    assert_matches_shadow(cache, shadow, "prefill")
    for step in range(13):
        before, old_shadow = cache, shadow.copy()
        cache = _append(cache, shadow, rows(rng, 1, "mixed"), np.array([1, 1, step % 2]))
        assert_matches_shadow(cache, shadow, f"decode {step}")
        # frontier rule: a one-row append wrote only slots invisible at the old lengths
        assert_matches_shadow(cache.replace(lengths=before.lengths), old_shadow, f"decode {step} at old lengths")
    before, old_shadow = cache, shadow.copy()
    cache = _append(cache, shadow, rows(rng, T_PREFILL, "normal"), np.array([2, 5, 4]))
    assert_matches_shadow(cache, shadow, "second prefill")
    keeps = all(s.append_keeps_old_view(T_PREFILL) for s in policy)
    assert keeps == (not isinstance(policy[0], KIVIScheme))
    if keeps:
        assert_matches_shadow(cache.replace(lengths=before.lengths), old_shadow, "multi-row append at old lengths")


@pytest.mark.parametrize("case", CASE_IDS)
def test_nan_in_one_layer_v_rejects_and_leaves_every_layer_unchanged(case):
    rng = np.random.default_rng(2)
    policy = CASES[case]
    cache, shadow = _build(policy, rng, [(5, 4, 2), 1, 1, 1, 1])
    before = [np.array(a) for a in jax.tree.leaves(cache)]
    for t, num in ((1, np.array([1, 1, 1])), (T_PREFILL, np.array([5, 2, 3]))):
        pairs = rows(rng, t)
        pairs[L - 1][1][1, 0, 1, 3] = np.nan                                     # last layer, V, sequence 1
        with pytest.raises(ValueError, match=rf"layer {L - 1} V has non-finite values"):
            ops.append(cache, pairs, num)
        for a, b in zip(before, jax.tree.leaves(cache)):
            np.testing.assert_array_equal(a.view(np.uint8), np.asarray(b).view(np.uint8))
        # jit path: nothing published, the returned cache is logically the old one
        new, ok = ops.try_append_jit(cache, pairs, jnp.asarray(num, jnp.int32))
        assert not bool(ok)
        np.testing.assert_array_equal(np.asarray(new.lengths), np.asarray(cache.lengths))
        assert_matches_shadow(new, shadow, f"rejected jit append t={t}")
    # padding rows may be garbage without effect
    pairs = rows(rng, T_PREFILL)
    pairs[0][0][0, 4, 0, 0] = np.inf                                             # row 4 of seq 0 is padding
    cache = ops.append(cache, pairs, np.array([4, 1, 0]))
    shadow.append(pairs, np.array([4, 1, 0]))
    assert_matches_shadow(cache, shadow, "append with garbage padding")


@pytest.mark.parametrize("case", ["int8", "kivi2_official", "qserve4"])
def test_finite_but_unencodable_row_is_rejected_atomically(case):
    """A finite value whose stored fp16 qparam / residual would overflow: append raises, try_append reports
    ok=False, nothing is published."""
    rng = np.random.default_rng(9)
    cache, shadow = _build(CASES[case], rng, [(5, 2, 3), 1])
    pairs = rows(rng, 1)
    pairs[1][0][2, 0, 1, :] = np.float32(3e9)                   # layer 1, K, sequence 2: beyond fp16 range
    pairs[1][0][2, 0, 1, 0] = np.float32(-3e9)
    with pytest.raises(ValueError, match="layer 1 sequence 2: a finite row could not be encoded"):
        ops.append(cache, pairs, 1)
    new, ok = ops.try_append_jit(cache, pairs, jnp.ones(B, jnp.int32))
    assert not bool(ok)
    assert_matches_shadow(new, shadow, "rejected unencodable append")


def _fresh_equivalent(policy, truncated):
    """The scheme a fresh build must use: FP8 warm-up scales are state, so the fresh build is given the very scales
    the surviving rows were encoded with (as calibrated scales)."""
    if not any(isinstance(s, FP8Scheme) and s.scales == "warmup" for s in policy):
        return policy, None
    cal = tuple(FP8Scheme(s.fmt, scales="calibrated", scale_axis=s.scale_axis, calibration_id="from-warmup")
                if isinstance(s, FP8Scheme) else s for s in policy)
    ks = np.stack([np.asarray(truncated.groups[0].k_scale)[i] for i in range(L)])
    vs = np.stack([np.asarray(truncated.groups[0].v_scale)[i] for i in range(L)])
    return cal, (ks, vs)


def _visible_equal(a, b, where):
    np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))
    lengths = np.asarray(a.lengths)
    for layer in range(L):
        sa, sb = a.scheme_for_layer(layer), b.scheme_for_layer(layer)
        ka, va, _ = (np.asarray(x) for x in ops.decode_reference(a, layer))
        kb, vb, _ = (np.asarray(x) for x in ops.decode_reference(b, layer))
        np.testing.assert_array_equal(ka, kb, err_msg=f"{where} layer {layer} K")
        np.testing.assert_array_equal(va, vb, err_msg=f"{where} layer {layer} V")
        gi = next(i for i, (_, f, n) in enumerate(a.schemes) if f <= layer < f + n)
        for bb in range(B):
            pa = physical(sa, jax_tree_index(a.groups[gi], layer - a.schemes[gi][1], bb, sa), int(lengths[bb]))
            pb = physical(sb, jax_tree_index(b.groups[gi], layer - b.schemes[gi][1], bb, sb), int(lengths[bb]))
            for key in pa:
                assert np.array_equal(np.asarray(pa[key]).view(np.uint8) if pa[key].dtype != np.int64 else pa[key],
                                      np.asarray(pb[key]).view(np.uint8) if pb[key].dtype != np.int64 else pb[key]), \
                    f"{where}: layer {layer} seq {bb} {key} differs from the fresh build"


@pytest.mark.parametrize("case", CASE_IDS)
def test_truncate_inside_group_then_append_equals_fresh_build(case):
    rng = np.random.default_rng(3)
    policy = CASES[case]
    # 5 + 14 decode rows: lengths (19, 18, 17): several closed KIVI K groups/chunks and a rolled V tail
    cache, shadow = _build(policy, rng, [(5, 4, 3)] + [1] * 14)
    new_lengths = np.array([10, 13, 6])                 # inside a K group, inside a chunk, inside the tail
    start = ops.rebuild_start(cache, new_lengths)
    want = np.array([min(needs_rows_spec(s, int(o), int(n)) for s in policy)
                     for o, n in zip(shadow.lengths, new_lengths)])
    np.testing.assert_array_equal(start, want)
    if (start < new_lengths).any():
        assert isinstance(policy[0], KIVIScheme) or isinstance(policy[-1], KIVIScheme)
        with pytest.raises(ops.TruncationNeedsRowsError, match="cannot be reopened exactly"):
            ops.truncate(cache, new_lengths)
        cut = ops.truncate(cache, new_lengths, rows=shadow.rows_from(start, new_lengths))
    else:
        cut = ops.truncate(cache, new_lengths)
    shadow.truncate(new_lengths)
    assert_matches_shadow(cut, shadow, "after truncate")
    more = rows(rng, T_PREFILL, "mixed")
    cut = ops.append(cut, more, np.array([5, 3, 4]))

    fresh_policy, scales = _fresh_equivalent(policy, cut)
    fresh = new_cache(fresh_policy)
    if scales is not None:
        fresh = load_scales(fresh, *scales)
    fresh = append_history(fresh, shadow, new_lengths)
    fresh = ops.append(fresh, more, np.array([5, 3, 4]))
    _visible_equal(cut, fresh, "truncate+append vs fresh")
    shadow.append(more, np.array([5, 3, 4]))
    assert_matches_shadow(cut, shadow, "truncate+append")


def append_history(cache, shadow, upto):
    """Append the shadow's original rows ``[0, upto[b])`` in static ``T_PREFILL``-row chunks."""
    done = np.zeros(B, np.int64)
    while (done < upto).any():
        end = np.minimum(done + T_PREFILL, upto)
        chunk = shadow.rows_from(done, end)
        cache = ops.append(cache, _pad(chunk, T_PREFILL) if chunk[0][0].shape[1] < T_PREFILL else chunk, end - done)
        done = end
    return cache


@pytest.mark.parametrize("case", ["kivi2_official", "kivi4_sync", "int4_g4", "fp8_e5m2_warmup_head"])
def test_truncate_to_zero_is_a_fresh_cache(case):
    rng = np.random.default_rng(4)
    policy = CASES[case]
    cache, shadow = _build(policy, rng, [(5, 5, 5), 1, 1, 1])
    cut = ops.truncate(cache, 0, rows=shadow.rows_from(np.zeros(B, np.int64), np.zeros(B, np.int64)))
    shadow.truncate(np.zeros(B, np.int64))
    assert_matches_shadow(cut, shadow, "truncated to zero")
    more = rows(rng, T_PREFILL)
    a = ops.append(cut, more, np.array([5, 2, 4]))
    b = ops.append(new_cache(policy), more, np.array([5, 2, 4]))
    _visible_equal(a, b, "re-warm after truncate to zero")


def test_truncate_rejects_bad_lengths_and_bad_rows():
    rng = np.random.default_rng(5)
    cache, shadow = _build(CASES["kivi2_official"], rng, [(5, 5, 5)] + [1] * 6)
    with pytest.raises(ValueError, match="must lie in"):
        ops.truncate(cache, np.array([12, 11, 99]))
    new = np.array([3, 4, 9])
    start = ops.rebuild_start(cache, new)
    good = shadow.rows_from(start, new)
    bad = [(k.copy(), v.copy()) for k, v in good]
    bad[1][0][0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="layer 1 K are not finite"):
        ops.truncate(cache, new, rows=bad)
    with pytest.raises(ValueError, match="rows hold"):
        ops.truncate(cache, new, rows=tuple((k[:, :1], v[:, :1]) for k, v in good))


@pytest.mark.parametrize("case", ["kivi2_official", "fp8_e5m2_warmup_head", "int4_g4", "fp8_e4m3_calibrated_skip0"])
def test_fork_and_reorder_move_everything_and_forks_are_independent(case):
    rng = np.random.default_rng(6)
    policy = CASES[case]
    cache, shadow = _build(policy, rng, [(5, 2, 4), 1, 1, 1, 1, 1, 1, 1])
    parent_leaves = [np.array(a) for a in jax.tree.leaves(cache)]
    parent_shadow = shadow.copy()
    child = ops.fork(cache, np.array([2, 2, 0]))
    shadow.fork([2, 2, 0])
    assert_matches_shadow(child, shadow, "fork")
    # the two copies of sequence 2 diverge; the parent does not move
    for _ in range(6):
        child = _append(child, shadow, rows(rng, 1, "mixed"), np.array([1, 1, 1]))
    assert_matches_shadow(child, shadow, "forks diverged")
    for a, b in zip(parent_leaves, jax.tree.leaves(cache)):
        np.testing.assert_array_equal(a.view(np.uint8), np.asarray(b).view(np.uint8))
    assert_matches_shadow(cache, parent_shadow, "parent after child appends")
    re = ops.reorder(child, np.array([1, 2, 0]))
    shadow.fork([1, 2, 0])
    assert_matches_shadow(re, shadow, "reorder")
    wide = ops.fork(cache, np.array([0, 1, 2, 1]))
    assert wide.batch == 4 and np.asarray(wide.lengths).tolist() == [int(x) for x in
                                                                     np.asarray(cache.lengths)[[0, 1, 2, 1]]]
    with pytest.raises(ValueError, match="out of range"):
        ops.fork(cache, np.array([0, 3]))
    with pytest.raises(ValueError, match="beam_order"):
        ops.reorder(cache, np.array([0, 1]))


def test_append_checks_capacity_shapes_and_tracing():
    cache = new_cache(CASES["int8"])
    rng = np.random.default_rng(7)
    with pytest.raises(ValueError, match="capacity"):
        for _ in range(6):
            cache = ops.append(cache, rows(rng, T_PREFILL), np.array([5, 5, 5]))
    with pytest.raises(ValueError, match="layers"):
        ops.append(cache, rows(rng, 1)[:1], 1)
    with pytest.raises(ValueError, match="num_new"):
        ops.append(cache, rows(rng, 1), 2)
    with pytest.raises(TypeError, match="try_append"):
        jax.jit(lambda c: ops.append(c, rows(rng, 1), 1))(cache)
    new, ok = ops.try_append_jit(new_cache(CASES["int8"]), rows(rng, 1), jnp.ones(B, jnp.int32))
    assert bool(ok) and np.asarray(new.lengths).tolist() == [1, 1, 1]


@pytest.mark.parametrize("case", ["kivi2_official", "int4_g4", "fp8_e5m2_warmup_head"])
def test_decode_append_under_jit_with_donation_does_not_copy_the_cache(case):
    """The donated cache is aliased to the output (no second cache-sized buffer) and consumed.

    FP8 on XLA:CPU is the documented exception: the CPU backend has no native float8 ops and lowers a float8
    scatter through a float16 upcast of the whole buffer (a cache-sized temporary); the buffers are still donated
    and aliased.  On GPU/TPU the strict bound applies to FP8 too."""
    policy = CASES[case]
    cap = 8192
    cache = new_cache(policy, capacity=cap)
    rng = np.random.default_rng(8)
    cache = ops.append(cache, rows(rng, T_PREFILL), np.array([5, 5, 5]))
    pairs = tuple((jnp.asarray(k), jnp.asarray(v)) for k, v in rows(rng, 1))
    step = jax.jit(ops.try_append, donate_argnums=0)
    compiled = step.lower(cache, pairs, jnp.ones(B, jnp.int32)).compile()
    mem = compiled.memory_analysis()
    cache_bytes = sum(int(a.nbytes) for a in jax.tree.leaves(cache))
    assert cache_bytes > 1_000_000
    # every cache buffer is aliased to an output (in-place update) ...
    assert mem.alias_size_in_bytes >= cache_bytes, (mem.alias_size_in_bytes, cache_bytes)
    # ... and no cache-sized temporary exists (the per-step workspace is a few rows per head)
    if isinstance(policy[0], FP8Scheme) and jax.default_backend() == "cpu":
        assert mem.temp_size_in_bytes <= 2 * cache_bytes + 4096, (mem.temp_size_in_bytes, cache_bytes)
    else:
        assert mem.temp_size_in_bytes < cache_bytes // 20, (mem.temp_size_in_bytes, cache_bytes)
    before = [np.array(a) for a in jax.tree.leaves(cache)]
    leaves = jax.tree.leaves(cache)
    new, ok = step(cache, pairs, jnp.ones(B, jnp.int32))
    assert bool(ok)
    assert all(a.is_deleted() for a in leaves), "donated cache buffers were not consumed"
    # the result equals the non-donated computation
    ref, _ = ops.try_append_jit(jax.tree.unflatten(jax.tree.structure(new), [jnp.asarray(a) for a in before]),
                                     pairs, jnp.ones(B, jnp.int32))
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
