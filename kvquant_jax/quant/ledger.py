"""Byte ledger of a KV-cache representation (design notes 0x04, 0x04A-0x04C, 0x0AC).

Every byte belongs to exactly one category:

    codes        quantized K/V payload (packed integer codes, FP8 values)
    qparams      scales, zero-points / mins / offsets, codebooks
    residual     full-precision rows (a full-precision cache, KIVI's recent residual rings)
    sparse       sparse outliers (values + indices)
    sink_prefix  rows kept for sink / prefix reasons (IntactKV, PrefixQuant)
    metadata     lengths / positions / page tables
    padding      alignment and packing waste (0 for layout v1: every packed row is whole bytes)

Three views for a shape ``(L, B, Hkv, D, T, capacity)``:

* ``physical``: bytes of the allocation at the static capacity ``C`` -- what the cache pytree really holds.  It
  must agree EXACTLY with :func:`measured_nbytes` of a cache of that shape (tested for every scheme).
* ``logical``: bytes the representation needs when every sequence holds ``T`` rows (codes only for rows actually
  quantized -- KIVI's K and V frontiers are counted separately --, qparams only for closed groups / encoded rows,
  residual only for rows still full precision).  ``physical - logical`` is capacity slack.
* ``read_per_step``: first-order bytes one decode step at length ``T`` reads (0x04C): every visible byte once
  (codes, qparams, live residual rows, metadata); it is the logical view of the attention-visible state.
  :func:`cumulative_read` sums it over ``N`` generated tokens.

The ledger is computed from the *schema* alone (the ABI: formats, group sizes, residual rule, dtypes), never from
the arrays, so agreement with the measured bytes also checks that the schema fully describes the layout.  Each
scheme owns its formula, next to its layout: ``CacheScheme.ledger_layer(batch, heads, head_dim, rows, *, logical,
capacity) -> {(category, "k" | "v"): bytes}`` for one layer (``rows`` = capacity for the physical view, the length
for the logical one); this module only sums those and draws the tables, so it does not import the cache layer
(schemes are duck-typed).  The contract: physical == measured, for every registered family.
"""
from __future__ import annotations

import dataclasses

from kvquant_jax.quant.dtypes import DTYPE_BYTES  # noqa: F401  (re-exported: the byte table of the ledger)

CATEGORIES = ("codes", "qparams", "residual", "sparse", "sink_prefix", "metadata", "padding")
MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class LedgerShape:
    """``num_layers`` L, ``batch`` B, ``num_kv_heads`` Hkv, ``head_dim`` D, logical ``length`` T (rows held by every
    sequence) and allocated ``capacity`` C >= T."""

    num_layers: int
    batch: int
    num_kv_heads: int
    head_dim: int
    length: int
    capacity: int

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            low = 0 if f.name == "length" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"LedgerShape.{f.name} must be an int >= {low}, got {v!r}")
        if self.length > self.capacity:
            raise ValueError(f"LedgerShape: length {self.length} exceeds capacity {self.capacity}")


@dataclasses.dataclass(frozen=True)
class Ledger:
    """Bytes by category for the three views (dicts over :data:`CATEGORIES`)."""

    shape: LedgerShape
    physical: dict
    logical: dict
    read_per_step: dict
    #: K and V counted separately: ``"{physical|logical}.{category}.{k|v}" -> bytes`` (KIVI's K and V frontiers
    #: differ, 0x04B: their code / qparam / residual rows are counted at their own lengths).
    by_tensor: dict = dataclasses.field(default_factory=dict)

    @staticmethod
    def total(view: dict) -> int:
        return int(sum(view.values()))

    @property
    def slack(self) -> int:
        """Allocated but not needed at length T (capacity slack, spare ring slots)."""
        return self.total(self.physical) - self.total(self.logical)


def _zero() -> dict:
    return {c: 0 for c in CATEGORIES}


def packed_bytes(head_dim: int, bits: int) -> int:
    """Bytes of one packed row of ``head_dim`` codes of ``bits`` bits (layout v1: whole bytes per row)."""
    return -(-head_dim * bits // 8)


def _per_layer(policy, num_layers: int) -> list:
    if isinstance(policy, (list, tuple)):
        if len(policy) != num_layers:
            raise ValueError(f"ledger: policy lists {len(policy)} layers, shape has {num_layers}")
        return list(policy)
    return [policy] * num_layers


def _layer_bytes(entry, b: int, h: int, d: int, rows: int, *, logical: bool, capacity: int) -> dict:
    """The scheme's own ``ledger_layer`` (each scheme owns its byte formula, next to its layout)."""
    if not hasattr(entry, "ledger_layer"):
        fam = getattr(getattr(entry, "schema", None), "scheme", type(entry).__name__)
        raise ValueError(f"ledger: no byte formula for scheme family {fam!r} (give the scheme a ledger_layer "
                         "method, see the module doc)")
    return entry.ledger_layer(b, h, d, rows, logical=logical, capacity=capacity)


def ledger(policy, shape: LedgerShape) -> Ledger:
    """Physical / logical / per-decode-step bytes of ``policy`` (a scheme or schema, or a per-layer sequence)."""
    s = shape
    detail = {"physical": {}, "logical": {}}
    for entry in _per_layer(policy, s.num_layers):
        for view, rows, is_logical in (("physical", s.capacity, False), ("logical", s.length, True)):
            for key, n in _layer_bytes(entry, s.batch, s.num_kv_heads, s.head_dim, rows, logical=is_logical,
                                       capacity=s.capacity).items():
                detail[view][key] = detail[view].get(key, 0) + n
    views = {}
    for view, parts in detail.items():
        views[view] = _zero()
        for (cat, _), n in parts.items():
            views[view][cat] += n
        views[view]["metadata"] += 4 * s.batch                              # lengths: int32 [B]
    return Ledger(shape=s, physical=views["physical"], logical=views["logical"],
                  read_per_step=dict(views["logical"]),
                  by_tensor={f"{view}.{cat}.{t}": n for view, parts in detail.items()
                             for (cat, t), n in sorted(parts.items())})


def cumulative_read(policy, shape: LedgerShape, new_tokens: int) -> int:
    """Total first-order bytes read by ``new_tokens`` decode steps starting at length ``shape.length`` (step ``i``
    attends over ``length + i`` retained rows), 0x04C."""
    total = 0
    for i in range(new_tokens):
        step = dataclasses.replace(shape, length=shape.length + i, capacity=max(shape.capacity, shape.length + i))
        total += Ledger.total(ledger(policy, step).read_per_step)
    return total


def measured_nbytes(cache) -> dict:
    """Real ``nbytes`` of a ``KVCache`` by category (each scheme's ``layer_nbytes`` on its stacked group state,
    plus ``lengths`` as metadata).  Duck-typed: needs ``cache.schemes``, ``cache.groups``, ``cache.lengths``."""
    out = _zero()
    for (scheme, _, _), state in zip(cache.schemes, cache.groups):
        for c, n in scheme.layer_nbytes(state).items():
            if c not in out:
                raise ValueError(f"measured_nbytes: {type(scheme).__name__} reports unknown category {c!r}")
            out[c] += int(n)
    out["metadata"] += int(cache.lengths.nbytes)
    return out


def _fmt(n: int) -> str:
    return f"{n:>15,d}  {n / MIB:>10.3f}"


def ledger_table(policy, shape: LedgerShape) -> str:
    """A plain-text table of the three views (bytes and MiB) plus effective bits per cached element."""
    led = ledger(policy, shape)
    s = shape
    lines = [f"KV cache byte ledger: L={s.num_layers} B={s.batch} Hkv={s.num_kv_heads} D={s.head_dim} "
             f"T={s.length} capacity={s.capacity}",
             f"{'category':<12} {'physical@C bytes':>17} {'MiB':>10} {'logical@T bytes':>17} {'MiB':>10} "
             f"{'read/step bytes':>17} {'MiB':>10}"]
    for c in CATEGORIES:
        lines.append(f"{c:<12} {_fmt(led.physical[c])}  {_fmt(led.logical[c])}  {_fmt(led.read_per_step[c])}")
    lines.append(f"{'total':<12} {_fmt(led.total(led.physical))}  {_fmt(led.total(led.logical))}  "
                 f"{_fmt(led.total(led.read_per_step))}")
    elems = 2 * s.num_layers * s.batch * s.num_kv_heads * s.head_dim * s.length
    if elems:
        bits = 8 * (led.total(led.logical) - led.logical["metadata"]) / elems
        lines.append(f"effective bits per cached K/V element at T (excl. metadata): {bits:.3f}")
    lines.append(f"capacity slack (physical - logical): {led.slack:,d} bytes ({led.slack / MIB:.3f} MiB)")
    return "\n".join(lines)
