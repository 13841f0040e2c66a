"""Hypothesis state machine: random append (prefill / decode) / fork / reorder / truncate / check_compatible
sequences on every scheme, checked after every step against the float64 NumPy shadow (bit-exact codes and qparams,
decoded K/V, lengths, frontiers, every validate() invariant, fork independence).

520 sequences of up to 8 steps (after 0-3 warm-up prefills) over the 12 scheme cases of ``cache_helpers.CASES``;
derandomized so CI is reproducible.  ``KVQ_SM_EXAMPLES=60`` shortens a local run.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvquant_jax.cache import ops
from kvquant_jax.cache.reuse import reuse_prefix
from kvquant_jax.cache.schema import IncompatibleSchemaError, check_compatible

from cache_helpers import B, C, CASES, T_PREFILL, assert_matches_shadow, new_cache, rows
from cache_shadow import ShadowCache, needs_rows_spec

CASE_IDS = sorted(CASES)
KINDS = ("normal", "mixed")


def _pad(pairs, t):
    return tuple((np.pad(k, [(0, 0), (0, t - k.shape[1]), (0, 0), (0, 0)]),
                  np.pad(v, [(0, 0), (0, t - v.shape[1]), (0, 0), (0, 0)])) for k, v in pairs)


class CacheMachine(RuleBasedStateMachine):
    """One cache + its shadow; a kept snapshot (value + shadow copy) checks that later operations never change an
    older cache value (forks and their parents are independent)."""

    @initialize(case=st.sampled_from(CASE_IDS), warm=st.integers(0, 3), data=st.data(),
                seed=st.integers(0, 2 ** 31))
    def setup(self, case, warm, data, seed):
        """Start from ``warm`` random prefills, so histories regularly outgrow KIVI's residual window (R=8)."""
        self.case = case
        self.policy = CASES[case]
        self.cache = new_cache(self.policy)
        self.shadow = ShadowCache(self.policy, B, 2, 8)
        self.snapshot = None
        for i in range(warm):
            num = np.array([data.draw(st.integers(0, T_PREFILL)) for _ in range(B)])
            pairs = rows(self._rng(seed + i), T_PREFILL, "mixed")
            self.cache = ops.append(self.cache, pairs, num)
            self.shadow.append(pairs, num)

    def _rng(self, seed):
        return np.random.default_rng(seed)

    def _room(self):
        return C - self.shadow.lengths

    @rule(data=st.data(), seed=st.integers(0, 2 ** 31), kind=st.sampled_from(KINDS))
    def prefill(self, data, seed, kind):
        room = self._room()
        num = np.array([data.draw(st.integers(0, int(min(T_PREFILL, r)))) for r in room])
        pairs = rows(self._rng(seed), T_PREFILL, kind)
        self.cache = ops.append(self.cache, pairs, num)
        self.shadow.append(pairs, num)
        event(f"prefill reaches capacity: {bool((self.shadow.lengths == C).any())}")

    @rule(data=st.data(), seed=st.integers(0, 2 ** 31), kind=st.sampled_from(KINDS))
    def decode(self, data, seed, kind):
        room = self._room()
        num = np.array([data.draw(st.integers(0, 1)) if r > 0 else 0 for r in room])
        pairs = rows(self._rng(seed), 1, kind)
        self.cache = ops.append(self.cache, pairs, num)
        self.shadow.append(pairs, num)

    @rule(parents=st.lists(st.integers(0, B - 1), min_size=B, max_size=B))
    def fork(self, parents):
        self.snapshot = (self.cache, self.shadow.copy())
        self.cache = ops.fork(self.cache, np.array(parents))
        self.shadow.fork(parents)

    @rule(order=st.permutations(list(range(B))))
    def reorder(self, order):
        self.cache = ops.reorder(self.cache, np.array(order))
        self.shadow.fork(order)

    @rule(data=st.data(), give_rows_first=st.booleans())
    def truncate(self, data, give_rows_first):
        old = self.shadow.lengths
        new = np.array([data.draw(st.integers(0, int(n))) for n in old])
        start = np.array([min(needs_rows_spec(s, int(o), int(n)) for s in self.policy) for o, n in zip(old, new)])
        np.testing.assert_array_equal(ops.rebuild_start(self.cache, new), start)
        needs = bool((start < new).any())
        event(f"truncate needs original rows: {needs}")
        if needs and not give_rows_first:
            with pytest.raises(ops.TruncationNeedsRowsError):
                ops.truncate(self.cache, new)
        rows_arg = _pad(self.shadow.rows_from(start, new), C) if needs else None
        self.cache = ops.truncate(self.cache, new, rows=rows_arg)
        self.shadow.truncate(new)

    @rule(field=st.sampled_from(["rope_theta", "tokenizer_hash", "key_stage", "model_id", "rope_pairing"]))
    def check_compatible_and_reuse(self, field):
        scheme = self.policy[-1]
        other = dataclasses.replace(scheme, **{field: {"rope_theta": 500000.0, "tokenizer_hash": "sha256:other",
                                                       "key_stage": "pre_rope", "model_id": "other-model",
                                                       "rope_pairing": "interleaved"}[field]})
        diff = check_compatible(scheme, other)
        assert not diff.ok and [d[0] for d in diff.differences] == [field]
        with pytest.raises(IncompatibleSchemaError, match=field):
            reuse_prefix(self.cache, self.policy[:-1] + (other,))
        same = reuse_prefix(self.cache, self.policy)
        assert same is self.cache

    @precondition(lambda self: self.snapshot is not None)
    @rule()
    def check_snapshot_untouched(self):
        cache, shadow = self.snapshot
        assert_matches_shadow(cache, shadow, f"{self.case}: pre-fork snapshot")

    @invariant()
    def matches_shadow(self):
        assert_matches_shadow(self.cache, self.shadow, self.case)


CacheMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVQ_SM_EXAMPLES", 520)), stateful_step_count=8, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], derandomize=True, database=None)
TestCacheStateMachine = CacheMachine.TestCase
