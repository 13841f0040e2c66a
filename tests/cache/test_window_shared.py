"""Layer-wide (shared) body state inside the sliding-window ring (``cache/window.py``): stored once, observed once.

* FP8 ``scales="warmup"`` in a window: the scales observed by the first append into the layer (the prefill) serve
  every block for the rest of the sequence, across many block restarts, ragged batch: the retained rows' codes
  equal the UNWINDOWED FP8 cache's bit for bit, and both equal an independent float64 NumPy FP8 quantizer with the
  prefill-observed scale.  (On the per-block layout each restarted block re-observed its scale from its first
  row(s): this fails.)
* truncation to 0 warms up again (the next append's rows), a positive truncation keeps the scale;
* fork / reorder / serialize round trips keep the one shared copy; the layout is in the schema (an artifact of the
  per-block layout is refused naming ``window_shared``); ledger / measured bytes count it once;
* the contract ``append == append_observed . observe_shared`` for every body family, and every registry body
  inside a window: physical ledger == measured bytes, ``validate`` holds.
"""
from __future__ import annotations

import dataclasses
import json
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.cache import ops, serialize
from kvquant_jax.cache.fp8 import FP8Scheme
from kvquant_jax.cache.interface import init_cache, layer_state
from kvquant_jax.cache.registry import make_scheme
from kvquant_jax.cache.schema import IncompatibleSchemaError
from kvquant_jax.cache.window import WindowScheme, split_blocks
from kvquant_jax.quant.ledger import LedgerShape, ledger, measured_nbytes

from family_specs import SPECS

B, H, D, C, W, BLOCK, T = 2, 2, 8, 64, 8, 4, 6
E4M3_MAX = 448.0


def _warm(axis):
    return FP8Scheme("e4m3", scales="warmup", scale_axis=axis)


# ----------------------------------------------------------------------------------------------------- oracle
def _e4m3_round(y):
    """float64 round-to-nearest-even onto the E4M3 grid (3 mantissa bits, min normal exponent -6), saturating."""
    y = np.clip(np.asarray(y, np.float64), -E4M3_MAX, E4M3_MAX)
    e = np.floor(np.log2(np.maximum(np.abs(y), 2.0 ** -6)))
    q = 2.0 ** (e - 3)
    return np.round(y / q) * q


def _oracle_scale(k_rows, axis):
    """float32 ``[H]``: amax / 448 over the prefill's valid rows (``k_rows``: list over sequences of [n, H, D])."""
    amax = np.max(np.abs(np.concatenate(k_rows, 0).astype(np.float64)), axis=(0, 2))
    if axis == "tensor":
        amax = np.full(H, amax.max())
    return np.where(amax == 0, np.float32(1), (amax / E4M3_MAX).astype(np.float32))


def _codes(x, scale):
    """Oracle codes (float64 grid values) of rows ``x [..., H, D]`` under per-head ``scale [H]``."""
    return _e4m3_round(np.asarray(x, np.float64) / scale.astype(np.float64)[:, None])


def _run(scheme, steps, rng, cache=None, hist=None):
    """Append ``steps`` (a list of ``num [B]``, T = max) of random rows to a fresh (or given) cache; ``hist``
    (per sequence: list of (k [n, H, D], v)) records them."""
    cache = cache or init_cache(scheme, num_layers=1, batch=B, capacity=C, num_kv_heads=H, head_dim=D)
    hist = hist if hist is not None else [([], []) for _ in range(B)]
    for num in steps:
        t = max(1, int(max(num)))
        k = (rng.normal(0, 1, (B, t, H, D)) * rng.uniform(0.5, 4.0)).astype(np.float32)
        v = rng.normal(0, 1, (B, t, H, D)).astype(np.float32)
        cache = ops.append(cache, [(k, v)], np.asarray(num))
        for b in range(B):
            hist[b][0].append(k[b, :num[b]])
            hist[b][1].append(v[b, :num[b]])
    return cache, hist


def _truncate(cache, new, hist):
    """``ops.truncate`` to ``new [B]``, given the original rows from ``rebuild_start`` on (``hist``, cut too)."""
    start = ops.rebuild_start(cache, new)
    rows = None
    if (start < new).any():
        t = int((new - start).max())
        k, v = np.zeros((2, B, t, H, D), np.float32)
        for b in range(B):
            n = int(new[b] - start[b])
            hk, hv = np.concatenate(hist[b][0]), np.concatenate(hist[b][1])
            k[b, :n], v[b, :n] = hk[start[b]:new[b]], hv[start[b]:new[b]]
        rows = [(k, v)]
    for b in range(B):
        hist[b] = ([np.concatenate(hist[b][0])[:new[b]]], [np.concatenate(hist[b][1])[:new[b]]])
    return ops.truncate(cache, new, rows=rows)


def _per_block_layout_blob(cache):
    """A blob of ``cache`` (one window layer) in the per-block layout written before the shared fields were stored
    once (``blk{j}__{field}`` for every body field, no ``window_shared`` in the schema), correctly signed."""
    sch = cache.schemes[0][0]
    grp = cache.groups[0]
    leaves = []
    for j in range(sch.num_blocks):
        for f in dataclasses.fields(type(grp).body_class):
            name = f"shared__{f.name}" if f.name in sch.shared_fields else f"blk{j}__{f.name}"
            leaves.append(np.asarray(getattr(grp, name)))
    leaves.append(np.asarray(cache.lengths))
    man = serialize.manifest(cache)
    schema = man["runs"][0]["schema"]
    schema["extra"] = [e for e in schema["extra"] if e[0] != "window_shared"]
    man["arrays"] = [{"shape": list(a.shape), "dtype": np.dtype(a.dtype).name} for a in leaves]
    man = serialize._sign(man)
    man["sha256"] = serialize._digest(man, leaves)
    head = json.dumps(man, sort_keys=True).encode()
    return serialize.MAGIC + struct.pack("<Q", len(head)) + head + b"".join(
        np.ascontiguousarray(a).view(np.uint8).reshape(-1).tobytes() for a in leaves)


def _retained(cache):
    """Per sequence: ``{position: (k codes, v codes, k scale, v scale)}`` (code grid values ``[H, D]`` read from the
    ring's raw fp8 codes, the scales ``[H]`` its block encodes with) of the window's view rows."""
    sch, st = layer_state(cache, 0)
    blocks = split_blocks(st)
    pos = np.asarray(sch.row_positions(cache.lengths))
    valid = np.asarray(sch.window_valid(cache.lengths))
    out = []
    for b in range(B):
        rows = {}
        for r in np.flatnonzero(valid[b]):
            blk, i = blocks[int(r) // BLOCK], int(r) % BLOCK
            rows[int(pos[b, r])] = tuple(np.asarray(a).astype(np.float64)
                                         for a in (blk.k[b, :, i], blk.v[b, :, i], blk.k_scale, blk.v_scale))
        out.append(rows)
    return out


def _check_equal_unwindowed(win, flat, k_scale, v_scale):
    """The window's retained codes == the unwindowed cache's codes at the same positions, bit for bit, == the
    oracle's codes under the prefill-observed scales; both caches hold exactly those scales."""
    rows = _retained(win)
    _, fst = layer_state(flat, 0)
    np.testing.assert_array_equal(np.asarray(fst.k_scale), k_scale)
    np.testing.assert_array_equal(np.asarray(fst.v_scale), v_scale)
    np.testing.assert_array_equal(np.asarray(win.lengths), np.asarray(flat.lengths))
    for b in range(B):
        L = int(win.lengths[b])
        assert sorted(rows[b]) == list(range(max(0, L - W + 1), L))
        for p, (kc, vc, ks, vs) in rows[b].items():
            np.testing.assert_array_equal(ks, k_scale, err_msg=f"K scale of the block of seq {b} pos {p}")
            np.testing.assert_array_equal(vs, v_scale, err_msg=f"V scale of the block of seq {b} pos {p}")
            np.testing.assert_array_equal(kc, np.asarray(fst.k[b, :, p]).astype(np.float64), err_msg=f"{b} {p}")
            np.testing.assert_array_equal(vc, np.asarray(fst.v[b, :, p]).astype(np.float64), err_msg=f"{b} {p}")


def _check_oracle(win, hist, k_scale, v_scale):
    rows = _retained(win)
    for b in range(B):
        hk, hv = np.concatenate(hist[b][0]), np.concatenate(hist[b][1])
        for p, (kc, vc, _, _) in rows[b].items():
            np.testing.assert_array_equal(kc, _codes(hk[p], k_scale), err_msg=f"K seq {b} pos {p}")
            np.testing.assert_array_equal(vc, _codes(hv[p], v_scale), err_msg=f"V seq {b} pos {p}")


# ------------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("axis", ["head", "tensor"])
def test_windowed_warmup_equals_unwindowed_across_block_restarts(axis):
    """Ragged prefill (6 and 3 rows: two blocks for sequence 0), then 20 ragged decode steps (over two laps of
    the 3-block ring): every step's retained rows are the unwindowed cache's codes under the prefill's scales."""
    body = _warm(axis)
    win_s = WindowScheme(body, window=W, block=BLOCK)
    steps = [[T, 3]] + [[1, 1 if s % 4 else 0] for s in range(20)]
    win, flat = None, None
    hist = None
    for i, num in enumerate(steps):
        win, hist = _run(win_s, [num], np.random.default_rng(i), win, hist)
        flat, _ = _run(body, [num], np.random.default_rng(i), flat)
        if i == 0:
            ks = _oracle_scale([h[0][0] for h in hist], axis)
            vs = _oracle_scale([h[1][0] for h in hist], axis)
        _check_equal_unwindowed(win, flat, ks, vs)
    _check_oracle(win, hist, ks, vs)
    assert int(win.lengths[0]) > 2 * win_s.ring_rows         # every block restarted at least twice
    ops.validate(win)


def test_truncate_to_zero_warms_up_again_and_a_positive_truncation_keeps_the_scale():
    body = _warm("head")
    win_s = WindowScheme(body, window=W, block=BLOCK)
    win, hist = _run(win_s, [[T, T]] + [[1, 1]] * 9, np.random.default_rng(0))
    flat, _ = _run(body, [[T, T]] + [[1, 1]] * 9, np.random.default_rng(0))
    first = _oracle_scale([h[0][0] for h in hist], "head")
    first_v = _oracle_scale([h[1][0] for h in hist], "head")
    # positive (ragged) truncation: one sequence at 0, the other keeps rows (evicted blocks rebuilt from the
    # original rows, with the layer's scales) -> still warm, old scales, == the unwindowed cache
    win = _truncate(win, np.array([0, 9]), hist)
    flat = ops.truncate(flat, np.array([0, 9]))
    _check_equal_unwindowed(win, flat, first, first_v)
    win, hist = _run(win_s, [[T, 1]], np.random.default_rng(5), win, hist)
    flat, _ = _run(body, [[T, 1]], np.random.default_rng(5), flat)
    _check_equal_unwindowed(win, flat, first, first_v)
    _check_oracle(win, hist, first, first_v)
    # every sequence to 0: the next append (the new prefill) observes new scales, in both caches alike
    win, flat = _truncate(win, np.zeros(B, int), hist), ops.truncate(flat, np.zeros(B, int))
    hist = [([], []) for _ in range(B)]
    win, hist = _run(win_s, [[T, 4]] + [[1, 1]] * 7, np.random.default_rng(7), win, hist)
    flat, _ = _run(body, [[T, 4]] + [[1, 1]] * 7, np.random.default_rng(7), flat)
    ks = _oracle_scale([h[0][0] for h in hist], "head")
    vs = _oracle_scale([h[1][0] for h in hist], "head")
    assert not np.array_equal(ks, first)
    _check_equal_unwindowed(win, flat, ks, vs)
    _check_oracle(win, hist, ks, vs)


def test_fork_reorder_serialize_keep_one_shared_copy():
    win_s = WindowScheme(_warm("head"), window=W, block=BLOCK)
    win, _ = _run(win_s, [[T, 3]] + [[1, 1]] * 7, np.random.default_rng(3))
    _, st = layer_state(win, 0)
    names = [f.name for f in dataclasses.fields(st)]
    assert names.count("shared__k_scale") == 1 and not any(n.endswith("__k_scale") and n.startswith("blk")
                                                          for n in names)
    assert set(win_s.unbatched_fields) == {"shared__k_scale", "shared__v_scale"}
    scale = np.asarray(st.shared__k_scale)
    for c in (ops.reorder(win, np.array([1, 1])), ops.fork(win, np.array([0, 1, 1])),
              serialize.from_bytes(serialize.to_bytes(win))):
        _, st2 = layer_state(c, 0)
        np.testing.assert_array_equal(np.asarray(st2.shared__k_scale), scale)
        ops.validate(c)
    back = serialize.from_bytes(serialize.to_bytes(win))
    for a, b in zip(jax.tree.leaves(back.groups), jax.tree.leaves(win.groups)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    # the stored layout is part of the schema: an artifact of the per-block layout (no window_shared) is refused
    assert ("window_shared", "k_scale,v_scale") in win_s.schema.extra
    with pytest.raises(IncompatibleSchemaError, match="window_shared"):
        serialize.from_bytes(_per_block_layout_blob(win))
    # a body without shared state keeps the old layout and schema
    assert not any(e[0] == "window_shared" for e in WindowScheme(make_scheme("int4"), window=W).schema.extra)


#: bodies with layer-wide state, or forwarding it (the others take both hooks' defaults: nothing to split)
SHARED_SPECS = {
    "fp8_warmup_tensor": "fp8_e4m3:scales=warmup",
    "fp8_warmup_head": "fp8_e4m3:scales=warmup,axis=head",
    "kv_fp8_int4": {"name": "kv", "k": "fp8_e4m3:scales=warmup,axis=head", "v": "int4:group_size=8"},
}
#: every other registry body inside a window (the family spec's window body is kv(fp8 warm-up, KIVI); the window
#: state machine covers fp32, int4, unit-scale fp8 and KIVI)
BODY_SPECS = {
    **{k: SHARED_SPECS[k] for k in ("fp8_warmup_head", "kv_fp8_int4")},
    "fp8_calibrated": {"name": "fp8_e4m3", "scales": "calibrated", "k_scales": [0.01], "v_scales": [0.02],
                       "calibration_id": "test"},
    "static_int": "static_int4",
    "qserve": "qserve4",
    "per_token_vt": "int4_vt",
    "token_planar": {"name": "int2_planar", "plane_rows": 2},
    "qserve_planar": {"name": "qserve4_planar", "plane_rows": 4},
    "fp8_vt_warmup_head": "fp8_e4m3_vt:scales=warmup,axis=head",
    "kvquant": SPECS["kvquant"],
}


@pytest.mark.parametrize("name", sorted(SHARED_SPECS))
def test_append_is_observe_then_append_observed(name):
    """The contract of ``observe_shared`` / ``append_observed_with_status`` (bit for bit), cold and warm; and the
    observed half really is what sets the scales (the encode half alone keeps the initial ones)."""
    scheme = make_scheme(SHARED_SPECS[name])
    st = scheme.init_layer(B, 16, H, 16)
    rng = np.random.default_rng(0)
    lengths = jnp.zeros((B,), jnp.int32)
    for num in ([5, 3], [1, 1]):
        k, v = (jnp.asarray(rng.normal(0, 3, (B, 5, H, 16)), jnp.float32) for _ in range(2))
        n = jnp.asarray(num, jnp.int32)
        want, ok = scheme.append_layer_with_status(st, lengths, k, v, n)
        seen = scheme.observe_shared(st, lengths, k, v, n)
        got, ok2 = scheme.append_observed_with_status(seen, lengths, k, v, n)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(ok), np.asarray(ok2))
        unseen, _ = scheme.append_observed_with_status(st, lengths, k, v, n)
        assert np.array_equal(np.asarray(unseen.k_scale), np.asarray(st.k_scale))
        assert np.array_equal(np.asarray(seen.k_scale), np.asarray(st.k_scale)) == bool(int(lengths.max()) > 0)
        st, lengths = want, lengths + n


@pytest.mark.parametrize("name", sorted(BODY_SPECS))
def test_every_body_in_a_window_counts_and_validates(name):
    """Three appends past a ring lap: validate holds, physical ledger == measured bytes (shared once),
    the window view is the last W positions."""
    s = WindowScheme(make_scheme(BODY_SPECS[name]), window=16, block=8)
    cache = init_cache(s, num_layers=1, batch=B, capacity=C, num_kv_heads=H, head_dim=16)
    rng = np.random.default_rng(1)
    for num in ([12, 7], [12, 12], [12, 5]):                 # 29 / 24 rows: every block of the 3 restarted
        t = max(num)
        kv = [(rng.normal(0, 1, (B, t, H, 16)).astype(np.float32), rng.normal(0, 1, (B, t, H, 16)).astype(np.float32))]
        cache = ops.append(cache, kv, np.array(num))
    ops.validate(cache)
    assert ledger(s, LedgerShape(1, B, H, 16, int(cache.lengths.max()), C)).physical == measured_nbytes(cache)
    sch, st = layer_state(cache, 0)
    valid = np.asarray(sch.window_valid(cache.lengths))
    assert valid.sum(1).tolist() == [min(16 - 1, int(x)) for x in np.asarray(cache.lengths)]
    shared = sch.shared_fields
    assert len(jax.tree.leaves(st)) == len(shared) + s.num_blocks * (len(dataclasses.fields(type(st).body_class))
                                                                      - len(shared))
