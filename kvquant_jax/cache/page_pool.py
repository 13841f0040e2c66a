"""The page allocator of a paged KV cache: pure functions over an immutable, host-side :class:`PoolState`.

Design notes 0x05D (release and quiescent reclamation).  A pool has ``num_pages`` physical pages (the device
pools of ``cache/paged.py`` hold one more, the never-allocated *trash page* ``num_pages`` that absorbs masked
writes).  Every page is in exactly one of three places:

* **referenced**: ``refcount[p] > 0`` (page-table entries of sequences, prefix-cache entries: every holder owns
  one reference);
* **quarantined**: released (refcount 0) while a step that may still read it was in flight; it waits in
  ``quarantine`` until every such step has *retired* (a step's outputs are ready, so its reads are done);
* **free**: on the free list, allocatable.

Every operation returns a new state and never modifies its argument (NumPy arrays are stored read-only), so a
failing operation -- :class:`PoolExhaustedError`, a reference-count underflow -- raises and the caller still holds
the old, valid state.  Page ids are plain ints; ``owner`` / ``logical_start`` record the page schema's dynamic
fields (0x05C: who allocated the page, which logical token its first row holds).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np


class PoolExhaustedError(RuntimeError):
    """Not enough free pages for an allocation (``need`` pages, ``free`` free, ``quarantined`` waiting)."""

    def __init__(self, need: int, free: int, quarantined: int, what: str = "allocate"):
        self.need, self.free, self.quarantined = need, free, quarantined
        super().__init__(f"{what}: page pool exhausted: need {need} pages, {free} free"
                         + (f" ({quarantined} more wait for in-flight steps to retire)" if quarantined else ""))


def _ro(a: np.ndarray) -> np.ndarray:
    a = np.array(a, copy=True)
    a.flags.writeable = False
    return a


@dataclasses.dataclass(frozen=True)
class PoolState:
    """Host-side allocator state (immutable).

    Attributes:
      refcount: int32 ``[N]`` references per page.
      owner: int64 ``[N]`` id of the request / prefix that allocated the page (-1 while free).
      logical_start: int64 ``[N]`` first logical position the page holds (-1 while free).
      free: tuple of free page ids (allocation takes from the front, in order).
      quarantine: tuple of ``(page, fence)``: released pages and the in-flight step ids they wait for.
      inflight: frozenset of step ids begun and not retired.
      next_step: the id the next :func:`begin_step` hands out.
    """

    refcount: np.ndarray
    owner: np.ndarray
    logical_start: np.ndarray
    free: tuple
    quarantine: tuple = ()
    inflight: frozenset = frozenset()
    next_step: int = 0

    @property
    def num_pages(self) -> int:
        return int(self.refcount.shape[0])

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_quarantined(self) -> int:
        return len(self.quarantine)

    @property
    def num_used(self) -> int:
        return int((self.refcount > 0).sum())


def new_pool(num_pages: int) -> PoolState:
    """All ``num_pages`` pages free."""
    if num_pages < 1:
        raise ValueError(f"page pool: num_pages must be >= 1, got {num_pages}")
    return PoolState(refcount=_ro(np.zeros(num_pages, np.int32)), owner=_ro(np.full(num_pages, -1, np.int64)),
                     logical_start=_ro(np.full(num_pages, -1, np.int64)), free=tuple(range(num_pages)))


def allocate(pool: PoolState, n: int, owner: int = -1, logical_starts: Iterable[int] | None = None,
             what: str = "allocate") -> tuple[PoolState, tuple[int, ...]]:
    """``n`` fresh pages with refcount 1.  Raises :class:`PoolExhaustedError` (old state untouched)."""
    if n < 0:
        raise ValueError(f"{what}: cannot allocate {n} pages")
    if n > len(pool.free):
        raise PoolExhaustedError(n, len(pool.free), len(pool.quarantine), what)
    pages = pool.free[:n]
    starts = [-1] * n if logical_starts is None else [int(s) for s in logical_starts]
    if len(starts) != n:
        raise ValueError(f"{what}: {len(starts)} logical starts for {n} pages")
    rc, ow, ls = np.array(pool.refcount), np.array(pool.owner), np.array(pool.logical_start)
    idx = np.asarray(pages, np.int64)
    rc[idx] = 1
    ow[idx] = owner
    ls[idx] = starts
    return dataclasses.replace(pool, refcount=_ro(rc), owner=_ro(ow), logical_start=_ro(ls),
                               free=pool.free[n:]), tuple(pages)


def _counts(pages) -> tuple[np.ndarray, np.ndarray]:
    p = np.asarray(list(pages), np.int64).reshape(-1)
    p = p[p >= 0]
    return np.unique(p, return_counts=True)


def incref(pool: PoolState, pages) -> PoolState:
    """One more reference to every listed page (repeats count; ids < 0 are ignored).  A free page raises."""
    u, c = _counts(pages)
    if not u.size:
        return pool
    if (u >= pool.num_pages).any() or (pool.refcount[u] == 0).any():
        bad = [int(p) for p in u if p >= pool.num_pages or pool.refcount[p] == 0]
        raise ValueError(f"incref: pages {bad} are not allocated (a free page cannot gain a reference)")
    rc = np.array(pool.refcount)
    rc[u] += c.astype(np.int32)
    return dataclasses.replace(pool, refcount=_ro(rc))


def decref(pool: PoolState, pages) -> PoolState:
    """Drop one reference per listed page (repeats count; ids < 0 ignored).  A page reaching 0 goes to the free
    list, or to the quarantine while any step is in flight (it may still be read).  Underflow raises."""
    u, c = _counts(pages)
    if not u.size:
        return pool
    if (u >= pool.num_pages).any() or (pool.refcount[u] < c).any():
        bad = [int(p) for p, n in zip(u, c) if p >= pool.num_pages or pool.refcount[p] < n]
        raise ValueError(f"decref: pages {bad} would drop below zero references")
    rc, ow, ls = np.array(pool.refcount), np.array(pool.owner), np.array(pool.logical_start)
    rc[u] -= c.astype(np.int32)
    dead = [int(p) for p in u if rc[p] == 0]
    ow[dead] = -1
    ls[dead] = -1
    if pool.inflight:
        fence = pool.inflight
        return dataclasses.replace(pool, refcount=_ro(rc), owner=_ro(ow), logical_start=_ro(ls),
                                   quarantine=pool.quarantine + tuple((p, fence) for p in dead))
    return dataclasses.replace(pool, refcount=_ro(rc), owner=_ro(ow), logical_start=_ro(ls),
                               free=pool.free + tuple(dead))


def begin_step(pool: PoolState) -> tuple[PoolState, int]:
    """Register an in-flight step (one that reads pages); returns its id.  Pages released before it retires
    stay quarantined."""
    s = pool.next_step
    return dataclasses.replace(pool, inflight=pool.inflight | {s}, next_step=s + 1), s


def retire_step(pool: PoolState, step: int) -> PoolState:
    """The step's outputs are ready (so its reads are done): quarantined pages that waited only for retired steps
    return to the free list.  Retiring an unknown step raises."""
    if step not in pool.inflight:
        raise ValueError(f"retire_step: step {step} is not in flight (in flight: {sorted(pool.inflight)})")
    inflight = pool.inflight - {step}
    keep, back = [], []
    for page, fence in pool.quarantine:
        (keep if fence & inflight else back).append((page, fence))
    return dataclasses.replace(pool, inflight=inflight, quarantine=tuple(keep),
                               free=pool.free + tuple(p for p, _ in back))


def check_pool(pool: PoolState, references: Iterable[int] | None = None) -> None:
    """Host-side invariants: every page in exactly one of referenced / quarantined / free, no page twice in the
    free list, and (when ``references`` lists every holder's page ids) ``refcount == #references``.  Raises
    ``AssertionError`` naming the pages."""
    n = pool.num_pages
    free = np.asarray(pool.free, np.int64)
    quar = np.asarray([p for p, _ in pool.quarantine], np.int64)
    assert len(set(pool.free)) == len(pool.free), f"free list repeats pages {sorted(pool.free)}"
    where = np.zeros(n, np.int64)
    np.add.at(where, free, 1)
    np.add.at(where, quar, 1)
    where += pool.refcount > 0
    assert (where == 1).all(), f"pages not in exactly one of referenced/quarantined/free: " \
                               f"{np.nonzero(where != 1)[0].tolist()}"
    if references is not None:
        refs = np.asarray(list(references), np.int64).reshape(-1)
        want = np.bincount(refs[refs >= 0], minlength=n)
        bad = np.nonzero(want != pool.refcount)[0]
        assert not bad.size, f"refcount != references for pages {bad.tolist()}: " \
                             f"{pool.refcount[bad].tolist()} vs {want[bad].tolist()}"
