"""The sliding-window ring (``cache/window.py``) around several body schemes, against independent oracles.

Oracle of the stored rows: the full history of appended K/V rows (NumPy, per sequence and position).  After every
step of a hypothesis state machine (prefill / decode / fork / reorder / truncate / serialize round trip):

* the window view is exactly positions ``[L - W + 1, L)`` (``valid`` and ``row_positions``);
* each block's decoded rows equal a FRESH body cache built from that chunk's original rows in one append (bit
  for bit: codes, qparams and residual rows of evicted positions leave no trace; the body's frontiers come from
  the block length alone) -- except for a body with layer-wide state set from the data (FP8 warm-up), whose
  blocks use the layer's scales;
* for a body encoding every row on its own (``ROWWISE``, FP8 warm-up included) the window's view rows equal an
  unwindowed shadow cache of the body fed the same operations, bit for bit;
* decode attention over ``decode_regions`` equals a float64 NumPy softmax over the window rows;
* ``ops.validate`` holds and the physical ledger equals the measured bytes; the logical ledger counts exactly
  the retained rows.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvquant_jax.attention import dispatch
from kvquant_jax.cache import ops, serialize
from kvquant_jax.cache.fp8 import FP8Scheme
from kvquant_jax.cache.full import FullPrecisionScheme
from kvquant_jax.cache.interface import init_cache, layer_state
from kvquant_jax.cache.kivi import KIVIScheme
from kvquant_jax.cache.per_token import PerTokenScheme
from kvquant_jax.cache.registry import make_scheme, scheme_from_config
from kvquant_jax.cache.window import WindowScheme
from kvquant_jax.quant.ledger import LedgerShape, ledger, measured_nbytes

B, H, D, C, W, BLOCK, T = 2, 1, 8, 48, 8, 4, 5
BODIES = {
    "fp32": FullPrecisionScheme("fp32"),
    "int4_g4": PerTokenScheme(bits=4, group_size=4),
    "fp8_unit": FP8Scheme("e4m3"),
    "kivi2": KIVIScheme(k_bits=2, v_bits=2, group_size=4, v_group_size=4, residual=4),
    "fp8_warmup": FP8Scheme("e4m3", scales="warmup"),
}
#: bodies that encode every row on its own: the window's view rows equal an UNWINDOWED cache of the body fed the
#: same operations (a shadow), bit for bit -- for FP8 warm-up that is the layer's scales observed by its first
#: append, whatever the block (a fresh block would re-observe them, so it has no fresh-block oracle)
ROWWISE = ("fp32", "int4_g4", "fp8_unit", "fp8_warmup")
LAYER_SHARED = ("fp8_warmup",)


def _scheme(body):
    return WindowScheme(BODIES[body], window=W, block=BLOCK)


@functools.lru_cache(maxsize=None)
def _fresh_block(body):
    """jit: a fresh body state of ``BLOCK`` rows holding ``n`` rows (one append) -> its materialized K/V."""
    sch = BODIES[body]

    @jax.jit
    def f(k, v, n):
        stt = sch.init_layer(1, BLOCK, H, D)
        stt = sch.append_layer(stt, jnp.zeros((1,), jnp.int32), k, v, n)
        kk, vv, _ = sch.materialize_layer(stt, n)
        return kk, vv
    return f


def _rows(rng, t):
    return (rng.normal(0, 1, (B, t, H, D)).astype(np.float32) * 2, rng.normal(0, 1, (B, t, H, D)).astype(np.float32))


def _attention64(q, k, v, kn, vn):
    """float64 softmax of q [Hq, D] over rows k, v [N, Hkv, D] plus the current row kn, vn [Hkv, D]."""
    kk = np.concatenate([k, kn[None]], 0).astype(np.float64)
    vv = np.concatenate([v, vn[None]], 0).astype(np.float64)
    g = q.shape[0] // kk.shape[1]
    kk, vv = np.repeat(kk, g, axis=1), np.repeat(vv, g, axis=1)           # [N+1, Hq, D]
    s = np.einsum("hd,nhd->hn", q.astype(np.float64), kk) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hn,nhd->hd", p, vv)


def _shadow(body):
    """An unwindowed cache of a row-wise body (None for the others)."""
    return init_cache(BODIES[body], num_layers=1, batch=B, capacity=C, num_kv_heads=H, head_dim=D) \
        if body in ROWWISE else None


def check_against_history(cache, body, hist_k, hist_v, seed=0, flat=None):
    """The module doc's checks of ``cache`` (one layer) against the per-sequence row histories, and against the
    unwindowed shadow ``flat`` of a row-wise body."""
    sch, stt = layer_state(cache, 0)
    lengths = np.asarray(cache.lengths)
    k, v, valid = (np.asarray(a) for a in sch.materialize_layer(stt, cache.lengths))
    pos = np.asarray(sch.row_positions(cache.lengths))
    blocks = sch.num_blocks
    if flat is not None:
        np.testing.assert_array_equal(np.asarray(flat.lengths), lengths)
        fsch, fst = layer_state(flat, 0)
        fk, fv, _ = (np.asarray(a) for a in fsch.materialize_layer(fst, flat.lengths))
        for b in range(B):
            p = pos[b][valid[b]]
            np.testing.assert_array_equal(k[b][:, valid[b]], fk[b][:, p])
            np.testing.assert_array_equal(v[b][:, valid[b]], fv[b][:, p])
    for b in range(B):
        L = int(lengths[b])
        want = np.arange(max(0, L - W + 1), L)
        assert sorted(pos[b][valid[b]].tolist()) == want.tolist(), (b, L)
        assert not k[b][:, ~valid[b]].any() and not v[b][:, ~valid[b]].any()
        for j in range(blocks if body not in LAYER_SHARED else 0):
            rows = pos[b, j * BLOCK:(j + 1) * BLOCK]
            if rows[0] < 0 or rows[0] >= L:
                continue
            n = min(BLOCK, L - int(rows[0]))
            kc = np.zeros((1, BLOCK, H, D), np.float32)
            vc = np.zeros((1, BLOCK, H, D), np.float32)
            kc[0, :n], vc[0, :n] = hist_k[b][rows[0]:rows[0] + n], hist_v[b][rows[0]:rows[0] + n]
            fk, fv = (np.asarray(a)[0] for a in _fresh_block(body)(kc, vc, jnp.asarray([n], jnp.int32)))
            sel = valid[b, j * BLOCK:(j + 1) * BLOCK]
            np.testing.assert_array_equal(k[b][:, j * BLOCK:(j + 1) * BLOCK][:, sel], fk[:, sel])
            np.testing.assert_array_equal(v[b][:, j * BLOCK:(j + 1) * BLOCK][:, sel], fv[:, sel])
    # decode attention over the regions (reference impl) vs float64 over the window rows
    rng = np.random.default_rng(seed)
    q = rng.normal(0, 1, (B, 4 * H, D)).astype(np.float32)
    kn, vn = rng.normal(0, 1, (2, B, H, D)).astype(np.float32)
    out = np.asarray(dispatch.decode_attention(jnp.asarray(q), sch, stt, cache.lengths, kn, vn, impl="reference"))
    for b in range(B):
        idx = np.flatnonzero(valid[b])
        want = _attention64(q[b], np.swapaxes(k[b][:, idx], 0, 1), np.swapaxes(v[b][:, idx], 0, 1), kn[b], vn[b])
        np.testing.assert_allclose(out[b], want, rtol=2e-5, atol=2e-6)
    ops.validate(cache)
    assert ledger(cache.per_layer_schemes, LedgerShape(1, B, H, D, int(lengths.max()), C)).physical == \
        measured_nbytes(cache)


class WindowMachine(RuleBasedStateMachine):
    @initialize(body=st.sampled_from(sorted(BODIES)), seed=st.integers(0, 2 ** 20))
    def setup(self, body, seed):
        self.body = body
        self.rng = np.random.default_rng(seed)
        self.cache = init_cache(_scheme(body), num_layers=1, batch=B, capacity=C, num_kv_heads=H, head_dim=D)
        self.flat = _shadow(body)
        self.hk = [np.zeros((0, H, D), np.float32) for _ in range(B)]
        self.hv = [np.zeros((0, H, D), np.float32) for _ in range(B)]

    def _append(self, t, num):
        k, v = _rows(self.rng, t)
        self.cache = ops.append(self.cache, [(k, v)], num)
        if self.flat is not None:
            self.flat = ops.append(self.flat, [(k, v)], num)
        for b in range(B):
            self.hk[b] = np.concatenate([self.hk[b], k[b, :num[b]]])
            self.hv[b] = np.concatenate([self.hv[b], v[b, :num[b]]])

    @rule(data=st.data())
    def prefill(self, data):
        room = C - np.asarray(self.cache.lengths)
        self._append(T, np.array([data.draw(st.integers(0, int(min(T, r)))) for r in room]))

    @rule(data=st.data())
    def decode(self, data):
        room = C - np.asarray(self.cache.lengths)
        for _ in range(data.draw(st.integers(1, 6))):
            self._append(1, np.array([1 if r > 0 else 0 for r in room]))
            room = C - np.asarray(self.cache.lengths)

    @rule(parents=st.lists(st.integers(0, B - 1), min_size=B, max_size=B))
    def reorder(self, parents):
        self.cache = ops.reorder(self.cache, np.array(parents))
        if self.flat is not None:
            self.flat = ops.reorder(self.flat, np.array(parents))
        self.hk = [self.hk[p].copy() for p in parents]
        self.hv = [self.hv[p].copy() for p in parents]

    @rule(data=st.data())
    def truncate(self, data):
        lengths = np.asarray(self.cache.lengths)
        new = np.array([data.draw(st.integers(0, int(x))) for x in lengths])
        start = ops.rebuild_start(self.cache, new)
        rows = None
        if (start < new).any():
            t = int((new - start).max())
            k = np.zeros((B, t, H, D), np.float32)
            v = np.zeros((B, t, H, D), np.float32)
            for b in range(B):
                n = int(new[b] - start[b])
                k[b, :n], v[b, :n] = self.hk[b][start[b]:new[b]], self.hv[b][start[b]:new[b]]
            rows = [(k, v)]
        self.cache = ops.truncate(self.cache, new, rows=rows)
        if self.flat is not None:
            self.flat = ops.truncate(self.flat, new)
        self.hk = [self.hk[b][:new[b]] for b in range(B)]
        self.hv = [self.hv[b][:new[b]] for b in range(B)]

    @rule()
    def serialize_round_trip(self):
        back = serialize.from_bytes(serialize.to_bytes(self.cache))
        for a, b in zip(jax.tree.leaves(back.groups), jax.tree.leaves(self.cache.groups)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert back.schemes == self.cache.schemes
        self.cache = back

    @invariant()
    def matches_history(self):
        if hasattr(self, "cache"):
            check_against_history(self.cache, self.body, self.hk, self.hv, flat=self.flat)


TestWindowMachine = WindowMachine.TestCase
TestWindowMachine.settings = settings(max_examples=24, stateful_step_count=6, deadline=None, derandomize=True)


@pytest.mark.parametrize("body", sorted(BODIES))
def test_long_decode_past_many_windows(body):
    """A prefill then 3 windows of decode steps: every step's view is the window, rows from fresh body blocks."""
    rng = np.random.default_rng(1)
    cache = init_cache(_scheme(body), num_layers=1, batch=B, capacity=C, num_kv_heads=H, head_dim=D)
    flat = _shadow(body)
    hk = [np.zeros((0, H, D), np.float32)] * B
    hv = [np.zeros((0, H, D), np.float32)] * B
    for step in range(3 * W + 2):
        t = T if step == 0 else 1
        k, v = _rows(rng, t)
        num = np.array([t, t if step % 3 else 0])
        cache = ops.append(cache, [(k, v)], num)
        flat = ops.append(flat, [(k, v)], num) if flat is not None else None
        hk = [np.concatenate([hk[b], k[b, :num[b]]]) for b in range(B)]
        hv = [np.concatenate([hv[b], v[b, :num[b]]]) for b in range(B)]
        check_against_history(cache, body, hk, hv, seed=step, flat=flat)


def test_rejected_prefill_keeps_the_old_ring():
    """A multi-row append with a non-finite row is rejected and publishes the old ring whole (every field is a
    ring field: the append may restart blocks the old length still shows)."""
    rng = np.random.default_rng(2)
    cache = init_cache(_scheme("fp32"), num_layers=1, batch=B, capacity=C, num_kv_heads=H, head_dim=D)
    k, v = _rows(rng, T)
    cache = ops.append(cache, [(k, v)], np.array([T, T]))
    k2, v2 = _rows(rng, T)
    k2[0, 4, 0, 0] = np.nan
    new, ok = ops.try_append_jit(cache, ((jnp.asarray(k2), jnp.asarray(v2)),), jnp.asarray([T, T], jnp.int32))
    assert not bool(ok)
    for a, b in zip(jax.tree.leaves(new.groups), jax.tree.leaves(cache.groups)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(new.lengths), np.asarray(cache.lengths))


def test_ledger_counts_retained_rows():
    """The logical ledger of a window layer counts the rows its blocks really hold (never more than W + block,
    whatever T), the physical one the ring allocation; both fixed past the window."""
    s = WindowScheme(FullPrecisionScheme("fp32"), window=512, block=128)
    per_row = 2 * 2 * 1 * 256 * 4                                        # K+V, B=2, Hkv=1, D=256, fp32
    for t in (1, 100, 512, 513, 700, 32768):
        retained = sum(s.retained_rows(t))
        assert min(t, 512) <= retained <= 512 + 128
        lg = ledger((s,), LedgerShape(1, 2, 1, 256, t, 32768))
        assert lg.logical["residual"] == retained * per_row
        assert lg.physical["residual"] == 5 * 128 * per_row
    assert sum(s.retained_rows(32768)) == 640                 # 32768 = 256 whole blocks: the last 5 held whole
    assert sum(s.retained_rows(32768 + 1)) == 512 + 1         # the next row restarts the oldest block


def test_specs_config_and_bad_input():
    s = make_scheme({"name": "window", "window": 16, "body": "int4"}, rope_theta=1e4)
    assert s.block == 4 and s.num_blocks == 5 and s.body.rope_theta == 1e4 and s.rope_theta == 1e4
    assert scheme_from_config(s.config()) == s
    assert ("window", "16") in s.schema.extra
    with pytest.raises(ValueError, match="block must be a positive int dividing window 16"):
        WindowScheme(FullPrecisionScheme(), window=16, block=5)
    with pytest.raises(ValueError, match="window must be a positive int"):
        WindowScheme(FullPrecisionScheme(), window=0)
    with pytest.raises(TypeError, match="neither a window nor a prefix"):
        WindowScheme(WindowScheme(FullPrecisionScheme(), window=8), window=8)
