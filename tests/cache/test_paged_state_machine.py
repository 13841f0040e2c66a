"""Hypothesis state machine over the paged cache (cache/paged.py, page_pool.py, prefix_cache.py).

Random allocate (prefill) / append (decode) / fork / beam reorder / share-prefix (slot copy, prefix-cache hit) /
truncate / release sequences, with in-flight steps begun and retired at random, on every registry family.  After
every step:

* the allocator matches a pure-NumPy ownership shadow: refcount == page-table entries + prefix-cache references
  (counted independently), every page exactly once referenced / quarantined / free (no leak), no free page
  referenced, a page released during an in-flight step stays quarantined until every such step retires;
* the materialized K/V (and valid mask) of every layer equal, bit for bit, the CONTIGUOUS cache
  (``cache/ops.py``, itself checked against the float64 shadow in test_cache_state_machine.py) given the same
  history -- so no stale row of a reused page is ever visible;
* every scheme invariant of the view (``ops.validate``); an exhausted pool raises ``PoolExhaustedError`` exactly
  when the demand (new pages + copy-on-write pages) exceeds the free pages, leaving the old state valid.

520 derandomized sequences of up to 10 steps; ``KVQ_PAGED_SM_EXAMPLES=40`` shortens a local run.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvquant_jax.cache import mixed, ops, page_pool as pp, paged, prefix_cache as pc_
from kvquant_jax.cache.interface import init_cache
from kvquant_jax.cache.registry import FAMILIES, make_scheme

from cache_helpers import B, CASES, D, H, L, T_PREFILL, rows

PAGE, MAX_PAGES, NUM_PAGES = 4, 6, 7             # 7 < B * MAX_PAGES = 18: the pool runs out
KIVI = {"name": "kivi2", "group_size": 4, "v_group_size": 4, "residual": 8}
EXTRA = {
    "int3": "int3",
    "int4_vt": "int4_vt",
    "fp8_e4m3_vt": "fp8_e4m3_vt:scales=warmup",
    "static_int4": "static_int4",
    "kvquant": {"name": "kvquant", "bits": 3, "k_sparse_capacity": 1, "v_outliers": 1, "sink": 1},
    "prefix_kivi": {"name": "prefix", "prefix_len": 2, "body": KIVI},
    "prefix_int4_copy": {"name": "prefix", "prefix_len": 3, "body": "int4", "shared": False},
    "kivi_axes": {"name": "kivi_axes", "k_axis": "token", "group_size": 4, "token_group_size": 4, "residual": 8},
    "kv_int8_kivi2": {"name": "kv", "k": "int8", "v": KIVI},
    "kivi2_planar": {**KIVI, "name": "kivi2_planar", "plane_rows": 1},     # 4-token blocks: one per page
    "int2_planar": {"name": "int2_planar", "plane_rows": 1},                 # 4-token blocks: one per page
    "qserve4_planar": {"name": "qserve4_planar", "plane_rows": 2},           # 4-token blocks: one per page
}
#: families the paged layout refuses, and why (a test checks the refusal)
NOT_PAGED = {"window": "a sliding-window ring keeps a bounded number of rows per sequence: no field grows with "
                       "capacity, so nothing is paged (an engine keeps local layers' rings per sequence)"}
PAGED_CASES = dict(CASES, **{k: mixed.uniform(make_scheme(v), L) for k, v in EXTRA.items()})
CASE_IDS = sorted(PAGED_CASES)
MODEL, TOK = "sha256:model", "sha256:tok"


def test_cases_cover_every_registry_family():
    fams = {s.family for pol in PAGED_CASES.values() for s in pol}
    assert fams | set(NOT_PAGED) == set(FAMILIES) and not fams & set(NOT_PAGED)


def test_a_window_ring_is_refused_by_the_paged_layout():
    pol = mixed.uniform(make_scheme({"name": "window", "window": 8, "block": 4, "body": "int4"}), L)
    with pytest.raises(ValueError, match="WindowScheme has no field that grows with capacity"):
        paged.init_paged(pol, num_layers=L, batch=B, num_pages=NUM_PAGES, page_size=PAGE, max_pages=MAX_PAGES,
                         num_kv_heads=H, head_dim=D)


def _init(case):
    pol = PAGED_CASES[case]
    cache, pool = paged.init_paged(pol, num_layers=L, batch=B, num_pages=NUM_PAGES, page_size=PAGE,
                                   max_pages=MAX_PAGES, num_kv_heads=H, head_dim=D)
    ref = init_cache(pol, num_layers=L, batch=B, capacity=cache.capacity, num_kv_heads=H, head_dim=D)
    return cache, pool, ref.replace(lengths=ref.lengths + cache.row_offset)


def _put_seq(ref, dst: int, src_ref, src: int, length: int):
    """Contiguous oracle of a prefix-cache hit: sequence ``dst`` of ``ref`` becomes sequence ``src`` of
    ``src_ref`` cut to ``length`` positions (batched fields only; shared fields are equal by construction; an
    entry shorter than its source's length only exists for schemes whose rows are final, where a shorter length
    is just the cut)."""
    groups = []
    for (s, _, _), a, b in zip(ref.schemes, ref.groups, src_ref.groups):
        groups.append(a.replace(**{f: getattr(a, f) if f in s.unbatched_fields else
                                   getattr(a, f).at[:, dst].set(getattr(b, f)[:, src])
                                   for f in a.__dataclass_fields__}))
    return ref.replace(groups=tuple(groups), lengths=ref.lengths.at[dst].set(length))


class PagedMachine(RuleBasedStateMachine):
    @initialize(case=st.sampled_from(CASE_IDS), seed=st.integers(0, 2 ** 31))
    def setup(self, case, seed):
        self.case = case
        self.cache, self.pool, self.ref = _init(case)
        self.off = self.cache.row_offset
        self.rng = np.random.default_rng(seed)
        # per sequence, per layer: the K/V rows of positions off.. (the history, for truncate's rows=)
        self.hist = [[(np.zeros((0, H, D), np.float32),) * 2 for _ in range(L)] for _ in range(B)]
        self.tokens = [[] for _ in range(B)]
        self.pcache = pc_.PrefixCache()
        self.entry_refs = {}                      # content -> (contiguous value, seq, hist, tokens)
        self.quarantined = {}                     # page -> fence (set of in-flight steps at release)
        self.referenced = set()                   # pages referenced after the previous rule

    # ----- helpers -----
    def _lengths(self):
        return np.asarray(self.ref.lengths).astype(np.int64)

    def _expected_demand(self, num):
        """Pages the append needs: unmapped ones plus shared mutable ones (computed from the table here)."""
        table = np.asarray(self.cache.page_table)
        old = self._lengths()
        new = old + num
        refs = np.bincount(np.concatenate([table[table >= 0], np.asarray(self.pcache.references(), np.int64)]),
                           minlength=NUM_PAGES)
        first = np.maximum(self.cache.sealed(old) - self.off, 0) // PAGE
        need = self.cache.pages_needed(new)
        demand = 0
        for b in range(B):
            if new[b] > old[b]:
                for j in range(int(first[b]), int(need[b])):
                    p = table[b, j]
                    if p < 0:
                        demand += 1
                    elif refs[p] > 1:                 # copied for this holder; the last holder writes in place
                        demand += 1
                        refs[p] -= 1
        return demand

    def _append(self, t, kind, num):
        pairs = rows(self.rng, t, kind)
        demand = self._expected_demand(num)
        free_before = self.pool.num_free
        old_pages = np.asarray(self.cache.page_table).copy()
        if demand > free_before:
            with pytest.raises(pp.PoolExhaustedError):
                paged.append(self.cache, self.pool, pairs, num)
            event("pool exhausted")
            np.testing.assert_array_equal(np.asarray(self.cache.page_table), old_pages)
            return
        self.cache, self.pool = paged.append(self.cache, self.pool, pairs, num)
        assert self.pool.num_free == free_before - demand, "allocations != predicted demand"
        self.ref = ops.append(self.ref, pairs, num)
        for b in range(B):
            n = int(num[b])
            self.hist[b] = [(np.concatenate([hk, k[b, :n]]), np.concatenate([hv, v[b, :n]]))
                            for (hk, hv), (k, v) in zip(self.hist[b], pairs)]
            self.tokens[b] = self.tokens[b] + [int(x) for x in self.rng.integers(0, 3, n)]

    def _room(self):
        return self.cache.capacity - self._lengths()

    # ----- rules -----
    @rule(data=st.data(), kind=st.sampled_from(("normal", "mixed")))
    def prefill(self, data, kind):
        num = np.array([data.draw(st.integers(0, int(min(T_PREFILL, r)))) for r in self._room()])
        self._append(T_PREFILL, kind, num)

    @rule(data=st.data())
    def decode(self, data):
        num = np.array([data.draw(st.integers(0, 1)) if r > 0 else 0 for r in self._room()])
        self._append(1, "normal", num)

    @rule(parents=st.lists(st.integers(0, B - 1), min_size=B, max_size=B))
    def fork(self, parents):
        self.cache, self.pool = paged.fork(self.cache, self.pool, np.array(parents))
        self.ref = ops.fork(self.ref, np.array(parents))
        self.hist = [self.hist[p] for p in parents]
        self.tokens = [self.tokens[p] for p in parents]

    @rule(order=st.permutations(list(range(B))))
    def reorder(self, order):
        self.fork(order)

    @rule(src=st.integers(0, B - 1), dst=st.integers(0, B - 1))
    def share_prefix(self, src, dst):
        self.cache, self.pool = paged.share(self.cache, self.pool, src, dst)
        idx = np.arange(B)
        idx[dst] = src
        self.ref = ops.fork(self.ref, idx)
        self.hist[dst], self.tokens[dst] = self.hist[src], self.tokens[src]

    @rule(data=st.data())
    def truncate(self, data):
        old = self._lengths()
        new = np.array([data.draw(st.integers(self.off, int(n))) for n in old])
        start = ops.rebuild_start(self.ref, new)
        rows_arg = None
        if (start < new).any():
            rows_arg = []
            for layer in range(L):
                k = np.zeros((B, self.cache.capacity, H, D), np.float32)
                v = np.zeros_like(k)
                for b in range(B):
                    s, n = int(start[b]) - self.off, int(new[b]) - self.off
                    k[b, : n - s], v[b, : n - s] = self.hist[b][layer][0][s:n], self.hist[b][layer][1][s:n]
                rows_arg.append((k, v))
            with pytest.raises(ops.TruncationNeedsRowsError):
                paged.truncate(self.cache, self.pool, new)
        self.cache, self.pool = paged.truncate(self.cache, self.pool, new, rows=rows_arg)
        self.ref = ops.truncate(self.ref, new, rows=rows_arg)
        for b in range(B):
            n = int(new[b]) - self.off
            self.hist[b] = [(hk[:n], hv[:n]) for hk, hv in self.hist[b]]
            self.tokens[b] = self.tokens[b][:n]

    @rule(seq=st.integers(0, B - 1))
    def release(self, seq):
        self.cache, self.pool = paged.release(self.cache, self.pool, [seq])
        lengths = self._lengths()
        lengths[seq] = self.off
        self.ref = ops.truncate(self.ref, lengths)
        self.hist[seq] = [(hk[:0], hv[:0]) for hk, hv in self.hist[seq]]
        self.tokens[seq] = []

    @rule()
    def begin_step(self):
        self.pool, _ = pp.begin_step(self.pool)

    @precondition(lambda self: bool(self.pool.inflight))
    @rule(data=st.data())
    def retire_step(self, data):
        step = data.draw(st.sampled_from(sorted(self.pool.inflight)))
        self.pool = pp.retire_step(self.pool, step)
        live = set(self.pool.inflight)
        self.quarantined = {p: f for p, f in self.quarantined.items() if f & live}

    @rule(seq=st.integers(0, B - 1))
    def register_prefix(self, seq):
        before = {c for c, _ in self.pcache.entries}
        self.pcache, self.pool = pc_.insert(self.pcache, self.cache, self.pool, seq, self.tokens[seq],
                                            model_hash=MODEL, tokenizer_hash=TOK)
        for c, e in self.pcache.entries:
            if c not in before:
                n = e.length - self.off
                self.entry_refs[c] = (self.ref, seq, [(hk[:n], hv[:n]) for hk, hv in self.hist[seq]],
                                      self.tokens[seq][:n])
                event("prefix registered")

    @rule(src=st.integers(0, B - 1), dst=st.integers(0, B - 1))
    def register_and_hit(self, src, dst):
        """The serving pattern: a finished prompt's pages are stored, a later request with that prompt maps them."""
        self.register_prefix(src)
        if self.pcache.entries:
            self._hit(self.pcache.entries[-1][0], dst)

    @precondition(lambda self: bool(self.pcache.entries))
    @rule(data=st.data(), seq=st.integers(0, B - 1))
    def prefix_hit(self, data, seq):
        self._hit(data.draw(st.sampled_from([c for c, _ in self.pcache.entries])), seq)

    def _hit(self, content, seq):
        ref, src, hist, tokens = self.entry_refs[content]
        self.release(seq)
        found = pc_.lookup(self.pcache, self.cache, tokens + [7], model_hash=MODEL, tokenizer_hash=TOK)
        assert found is not None and found.length >= self.off + len(tokens)
        entry = self.pcache.as_dict()[content]
        self.pcache, self.cache, self.pool = pc_.attach(self.pcache, self.cache, self.pool, entry, seq)
        self.ref = _put_seq(self.ref, seq, ref, src, entry.length)
        self.hist[seq], self.tokens[seq] = hist, tokens
        event("prefix hit")

    @precondition(lambda self: bool(self.pcache.entries))
    @rule()
    def evict_prefix(self):
        oldest = min((e for _, e in self.pcache.entries), key=lambda e: e.last_use)
        self.pcache, self.pool = pc_.evict(self.pcache, self.pool)
        del self.entry_refs[oldest.content]

    # ----- invariants -----
    @invariant()
    def ownership(self):
        table = np.asarray(self.cache.page_table)
        refs = np.bincount(np.concatenate([table[table >= 0], np.asarray(self.pcache.references(), np.int64)]),
                           minlength=NUM_PAGES)
        np.testing.assert_array_equal(self.pool.refcount, refs, err_msg="refcounts")
        now = set(np.nonzero(refs)[0].tolist())
        for p in self.referenced - now:           # released by the last rule: quarantined while steps are in flight
            if self.pool.inflight:
                self.quarantined[p] = set(self.pool.inflight)
        self.referenced = now
        quar = {p for p, _ in self.pool.quarantine}
        assert quar == set(self.quarantined), (quar, self.quarantined)
        free = set(self.pool.free)
        assert len(free) == len(self.pool.free)
        assert not free & set(np.nonzero(refs)[0].tolist()), "a referenced page is free"
        assert free | quar | set(np.nonzero(refs)[0].tolist()) == set(range(NUM_PAGES)), "page leaked"
        paged.validate(self.cache, self.pool, self.pcache.references())

    @invariant()
    def equals_contiguous(self):
        np.testing.assert_array_equal(np.asarray(self.cache.lengths), np.asarray(self.ref.lengths))
        got, want = jax.device_get((paged.materialize(self.cache), ops.decode_all(self.ref)))
        for layer, (g, w) in enumerate(zip(got, want)):
            for name, a, b in zip("kv", g[:2], w[:2]):
                np.testing.assert_array_equal(a, b, err_msg=f"{self.case} layer {layer} {name}")
            np.testing.assert_array_equal(g[2], w[2], err_msg=f"{self.case} layer {layer} valid")


PagedMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVQ_PAGED_SM_EXAMPLES", 520)), stateful_step_count=10, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], derandomize=True, database=None)
TestPagedStateMachine = PagedMachine.TestCase


def test_cow_shared_partial_page_on_first_append():
    """A shared partial page is copied on the first append of either holder; full sealed pages stay shared."""
    cache, pool, _ = _init("int8")
    rng = np.random.default_rng(1)
    cache, pool = paged.append(cache, pool, rows(rng, T_PREFILL), np.array([5, 0, 0]))   # pages 0 (full), 1 (1 row)
    cache, pool = paged.share(cache, pool, 0, 1)
    t0 = np.asarray(cache.page_table)
    assert (t0[0, :2] == t0[1, :2]).all() and pool.refcount[t0[0, 0]] == 2
    cache, pool = paged.append(cache, pool, rows(rng, 1), np.array([0, 1, 0]))
    t1 = np.asarray(cache.page_table)
    assert t1[1, 0] == t0[0, 0], "the full page must stay shared"
    assert t1[1, 1] != t0[0, 1] and pool.refcount[t0[0, 1]] == 1, "the partial page must be copied"
    k0 = np.asarray(paged.materialize(cache)[0][0])
    np.testing.assert_array_equal(k0[1, :, :5], k0[0, :, :5])


def test_in_flight_step_holds_released_pages():
    cache, pool, _ = _init("fp32")
    cache, pool = paged.append(cache, pool, rows(np.random.default_rng(2), T_PREFILL), np.array([5, 5, 0]))
    pool, step = pp.begin_step(pool)
    pages = [int(p) for p in np.asarray(cache.page_table)[0] if p >= 0]
    cache, pool = paged.release(cache, pool, [0])
    assert not set(pages) & set(pool.free) and {p for p, _ in pool.quarantine} == set(pages)
    pool = pp.retire_step(pool, step)
    assert set(pages) <= set(pool.free) and not pool.quarantine
    with pytest.raises(ValueError, match="not in flight"):
        pp.retire_step(pool, step)


def test_exhausted_pool_raises_and_keeps_state():
    cache, pool, _ = _init("fp32")
    small, spool = paged.init_paged(PAGED_CASES["fp32"], num_layers=L, batch=B, num_pages=2, page_size=PAGE,
                                    max_pages=MAX_PAGES, num_kv_heads=H, head_dim=D)
    with pytest.raises(pp.PoolExhaustedError, match="need 1 pages, 0 free"):
        paged.append(small, spool, rows(np.random.default_rng(3), T_PREFILL), np.array([5, 5, 0]))
    assert spool.num_free == 2 and (np.asarray(small.page_table) < 0).all()
    with pytest.raises(ValueError, match="capacity is 24"):
        paged.reserve(cache, pool, np.array([25, 0, 0]))


def test_kivi_page_must_hold_whole_groups():
    with pytest.raises(ValueError, match="group_size must divide page_size"):
        paged.init_paged(mixed.uniform(make_scheme(dict(KIVI, group_size=8, residual=8)), L), num_layers=L,
                         batch=B, num_pages=4, page_size=4, max_pages=2, num_kv_heads=H, head_dim=D)


def test_ledger_sums_to_measured_and_page_records():
    cache, pool, _ = _init("kivi2_official")
    cache, pool = paged.append(cache, pool, rows(np.random.default_rng(4), T_PREFILL), np.array([5, 3, 0]))
    led = paged.ledger(cache, pool)
    assert sum(led.values()) == paged.measured_nbytes(cache)
    per_page = paged.page_nbytes(cache)
    assert led["pages"] + led["slack_partial"] == per_page * pool.num_used == per_page * 3
    assert led["pages"] == per_page * 8 // PAGE                # 8 valid rows
    assert led["per_sequence"] > 0 and led["page_table"] == B * MAX_PAGES * 4 + B * 4
    recs = {r.page: r for r in paged.page_records(cache, pool)}
    t = np.asarray(cache.page_table)
    assert recs[int(t[0, 1])].valid_token_count == 1 and recs[int(t[0, 1])].logical_token_start == 4
    assert recs[int(t[1, 0])].owner == 1
    sch = recs[int(t[0, 0])].schemas[0]
    assert (sch.key_axis, sch.key_group_size, sch.value_axis, sch.layout_version) == ("channel", 4, "token", 2)
    assert not sch.residual_in_page and sch.key_qparams and not sch.key_signed and sch.key_zero == "min"


def test_prefix_cache_refuses_other_schema_naming_fields():
    cache, pool, _ = _init("int8")
    cache, pool = paged.append(cache, pool, rows(np.random.default_rng(5), T_PREFILL), np.array([4, 0, 0]))
    pcache, pool = pc_.insert(pc_.PrefixCache(), cache, pool, 0, [1, 2, 3, 4], model_hash=MODEL,
                              tokenizer_hash=TOK, calibration_id="cal-A")
    assert pool.refcount[int(np.asarray(cache.page_table)[0, 0])] == 2
    other, opool, _ = _init("int4_g4")
    with pytest.raises(pc_.IncompatibleSchemaError) as e:
        pc_.lookup(pcache, other, [1, 2, 3, 4, 5], model_hash=MODEL, tokenizer_hash=TOK, calibration_id="cal-A")
    msg = str(e.value)
    assert "layer0.key.payload" in msg and "layer0.key.group_size" in msg and "layer1.scheme" not in msg
    with pytest.raises(pc_.IncompatibleSchemaError, match="calibration_id"):
        pc_.lookup(pcache, cache, [1, 2, 3, 4, 5], model_hash=MODEL, tokenizer_hash=TOK, calibration_id="cal-B")
    assert pc_.lookup(pcache, cache, [1, 2, 3, 9], model_hash=MODEL, tokenizer_hash=TOK) is None   # other tokens
    assert pc_.lookup(pcache, cache, [1, 2, 3, 4], model_hash="other", tokenizer_hash=TOK) is None
    hit = pc_.lookup(pcache, cache, [1, 2, 3, 4, 5], model_hash=MODEL, tokenizer_hash=TOK, calibration_id="cal-A")
    assert hit is not None and hit.length == 4
