"""Decode-kernel tuning tables: which kernel (Mosaic GPU v1, warp-specialized, or, for full-precision caches, the
Pallas Triton region kernel) and config serves a layer, by measurement.

The tables are JSON files shipped in ``pallas_kernels/tuning/`` (one per device kind, e.g. ``decode_h200.json``),
written by ``experiments/check_mgpu_decode.py --tune PATH`` (after its timing) or ``--tune-from RESULTS_JSON
--tune PATH`` (from an existing results file, no GPU): per (format, T, head_dim, group) the fastest
implementation / variant among Mosaic v1 and the ws variants whose parity against the float64 oracle passed, and,
for the full-precision payloads both kernels read in place (:data:`DENSE_PAYLOADS`), the Triton kernel too.
``kvquant_jax.attention.dispatch`` asks :func:`choose` for every transposed-V layer and every single-region
bf16 / fp16 layer on a GPU and logs the reason.

Schema (every field required; :func:`validate_table` raises ``ValueError`` naming the file and the field)::

    {
      "schema": "kvquant_jax.decode_tuning/1",
      "device_kind": "NVIDIA H200",               # jax.devices()[0].device_kind the table was measured on
      "jax": "0.11.2",                            # JAX version of the measurement
      "date": "2026-12-02T07:06:55+00:00",        # date of the measurement (the results file's)
      "command": "python experiments/check_mgpu_decode.py ...",   # what wrote this table
      "source": "docs/results/.../check_mgpu_decode.json",        # the results it was built from
      "shape": {"B": 8, "hq": 32, "hkv": 8, "d": 128},          # the timed shape, or a list of them (a table
                                                  # pooled from runs of several shapes: --tune-from A.json,B.json)
      "entries": [                                # at most one per (format, head_dim, group, T); each entry's
                                                  # (head_dim, group) is (d, hq / hkv) of one of the shapes
        {"format": "int8",                        # KV payload: "bf16", "int8", "int4", "e4m3", ...
         "head_dim": 128, "group": 4,             # D and query heads per KV head of the timed shape
         "T": 32768,                              # timed rows (tokens per sequence): the bucket key
         "impl": "mgpu_ws",                       # "mgpu" (v1), "mgpu_ws" (warp-specialized) or "triton"
                                                  # (the Pallas Triton region kernel; DENSE_PAYLOADS only)
         "variant": "ws late-v",                  # the benchmark's variant label of the winner
         "config": {"block_t": 128, ...},          # fields of MgpuConfig ("mgpu") / MgpuWsConfig ("mgpu_ws")
         "us": 158.2,                             # the winner's median µs (the run's clock: device time)
         "v1_us": 169.2,                          # Mosaic v1 default's median µs at the same point
                                                  # (>= us; equal to it when the winner is v1 "default")
         "candidates": 9}                         # parity-passing candidates timed there
      ]
    }

Bucket rule (:func:`choose`): among the entries of the layer's (format, head_dim, group), the one of the largest
measured T <= the layer's capacity (rows), else the smallest measured T.  No table for the device kind, or no
entry for the (format, head_dim, group): the caller's ``fallback`` (v1 with its default config for a transposed-V
layer, which only Mosaic kernels read; the Triton kernel for a full-precision layer, the path it had before it was
measured) and a reason saying "no table entry".
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any, Optional

from pallas_kernels.decode_attention import KernelConfig
from pallas_kernels.decode_attention_mgpu import DENSE_PAYLOADS, MgpuConfig
from pallas_kernels.decode_attention_mgpu_ws import MgpuWsConfig

__all__ = ["SCHEMA", "TABLE_DIR", "IMPLS", "DENSE_PAYLOADS", "TuningEntry", "TuningTable", "validate_table",
           "load_table", "shipped_tables", "table_for", "choose"]

SCHEMA = "kvquant_jax.decode_tuning/1"
#: the shipped tables (package data)
TABLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuning")
#: implementation name -> the config dataclass whose fields an entry's ``config`` holds
IMPLS: dict[str, type] = {"mgpu": MgpuConfig, "mgpu_ws": MgpuWsConfig, "triton": KernelConfig}
_META = ("device_kind", "jax", "date", "command", "source")


@dataclasses.dataclass(frozen=True)
class TuningEntry:
    """One measured point: the winner at (format, head_dim, group, T) and the v1 time there (µs)."""

    format: str
    head_dim: int
    group: int
    T: int
    impl: str
    variant: str
    config: tuple[tuple[str, Any], ...]      # sorted (field, value) pairs: hashable
    us: float
    v1_us: float
    candidates: int

    def config_fields(self) -> dict[str, Any]:
        return dict(self.config)


@dataclasses.dataclass(frozen=True)
class TuningTable:
    """A validated table: ``name`` (file name), the measurement's metadata and its entries."""

    name: str
    device_kind: str
    jax: str
    date: str
    command: str
    source: str
    shapes: tuple[tuple[tuple[str, int], ...], ...]      # the timed shapes (sorted (key, value) pairs each)
    entries: tuple[TuningEntry, ...]


def _fail(name: str, field: str, msg: str):
    raise ValueError(f"decode tuning table {name}: field {field!r}: {msg}")


def _int(name, field, x, lo=1) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < lo:
        _fail(name, field, f"must be an integer >= {lo}, got {x!r}")
    return x


def _pos_float(name, field, x) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
        _fail(name, field, f"must be a finite number > 0, got {x!r}")
    return float(x)


def _str(name, field, x) -> str:
    if not isinstance(x, str) or not x:
        _fail(name, field, f"must be a non-empty string, got {x!r}")
    return x


def _object(name: str, at: str, obj: Any, keys: tuple[str, ...]) -> None:
    """``obj`` must be a JSON object with exactly ``keys`` (the field ``at`` named on failure)."""
    if not isinstance(obj, dict):
        _fail(name, at, f"must be an object, got {type(obj).__name__}")
    for k in keys:
        if k not in obj:
            _fail(name, f"{at}.{k}", "missing")
    extra = sorted(set(obj) - set(keys))
    if extra:
        _fail(name, f"{at}.{extra[0]}", f"unknown field (known: {', '.join(keys)})")


def _entry(name: str, i: int, e: Any) -> TuningEntry:
    at = f"entries[{i}]"
    _object(name, at, e, ("format", "head_dim", "group", "T", "impl", "variant", "config", "us", "v1_us",
                          "candidates"))
    impl = e["impl"]
    if impl not in IMPLS:
        _fail(name, f"{at}.impl", f"must be one of {sorted(IMPLS)}, got {impl!r}")
    if impl == "triton" and e["format"] not in DENSE_PAYLOADS:
        _fail(name, f"{at}.impl", f"'triton' serves only the payloads {DENSE_PAYLOADS} (read in place by both "
                                  f"kernels), not {e['format']!r}")
    cfg = e["config"]
    if not isinstance(cfg, dict):
        _fail(name, f"{at}.config", f"must be an object, got {type(cfg).__name__}")
    fields = {f.name for f in dataclasses.fields(IMPLS[impl])}
    for k, v in cfg.items():
        if k not in fields:
            _fail(name, f"{at}.config.{k}", f"not a field of {IMPLS[impl].__name__} (fields: {sorted(fields)})")
        if v is not None and not isinstance(v, (bool, int, str)):
            _fail(name, f"{at}.config.{k}", f"must be null, a boolean, an integer or a string, got {v!r}")
    us, v1 = _pos_float(name, f"{at}.us", e["us"]), _pos_float(name, f"{at}.v1_us", e["v1_us"])
    if impl == "mgpu" and e["variant"] == "default" and us != v1:
        _fail(name, f"{at}.v1_us", f"the v1 default winner's v1_us must equal its us ({us} != {v1})")
    if us > v1:
        _fail(name, f"{at}.us", f"a winner cannot be slower than the v1 default it was timed against ({us} > {v1})")
    return TuningEntry(format=_str(name, f"{at}.format", e["format"]),
                       head_dim=_int(name, f"{at}.head_dim", e["head_dim"]),
                       group=_int(name, f"{at}.group", e["group"]), T=_int(name, f"{at}.T", e["T"]), impl=impl,
                       variant=_str(name, f"{at}.variant", e["variant"]), config=tuple(sorted(cfg.items())),
                       us=us, v1_us=v1, candidates=_int(name, f"{at}.candidates", e["candidates"]))


def validate_table(obj: Any, name: str = "<table>") -> TuningTable:
    """A parsed JSON object -> :class:`TuningTable` (schema in the module docstring); ``ValueError`` naming ``name``
    and the first bad field otherwise."""
    if not isinstance(obj, dict):
        _fail(name, "<top level>", f"must be an object, got {type(obj).__name__}")
    known = ("schema",) + _META + ("shape", "entries")
    for k in known:
        if k not in obj:
            _fail(name, k, "missing")
    extra = sorted(set(obj) - set(known))
    if extra:
        _fail(name, extra[0], f"unknown field (known: {', '.join(known)})")
    if obj["schema"] != SCHEMA:
        _fail(name, "schema", f"must be {SCHEMA!r}, got {obj['schema']!r}")
    meta = {k: _str(name, k, obj[k]) for k in _META}
    shapes = _shapes(name, obj["shape"])
    timed = {(dict(sh)["d"], dict(sh)["hq"] // dict(sh)["hkv"]) for sh in shapes}
    entries = obj["entries"]
    if not isinstance(entries, list) or not entries:
        _fail(name, "entries", f"must be a non-empty list, got {entries!r}")
    out, seen = [], {}
    for i, e in enumerate(entries):
        ent = _entry(name, i, e)
        key = (ent.format, ent.head_dim, ent.group, ent.T)
        if key in seen:
            _fail(name, f"entries[{i}]", f"duplicates entries[{seen[key]}] (format, head_dim, group, T) = {key}")
        seen[key] = i
        if (ent.head_dim, ent.group) not in timed:
            _fail(name, f"entries[{i}]", f"(head_dim, group) = {(ent.head_dim, ent.group)} is not (d, hq / hkv) of "
                                         f"a timed shape ({sorted(timed)})")
        out.append(ent)
    return TuningTable(name=name, shapes=shapes, entries=tuple(out), **meta)


_SHAPE_KEYS = ("B", "hq", "hkv", "d")


def _shapes(name: str, shape: Any) -> tuple[tuple[tuple[str, int], ...], ...]:
    """The ``shape`` field (one object or a non-empty list of them, each with exactly ``B, hq, hkv, d``, ``hkv``
    dividing ``hq``) as sorted pair tuples, in the file's order."""
    one = isinstance(shape, dict)
    if not one and (not isinstance(shape, list) or not shape):
        _fail(name, "shape", f"must be an object or a non-empty list of objects, got {shape!r}")
    out = []
    for i, sh in enumerate([shape] if one else shape):
        at = "shape" if one else f"shape[{i}]"
        _object(name, at, sh, _SHAPE_KEYS)
        for k in _SHAPE_KEYS:
            _int(name, f"{at}.{k}", sh[k])
        if sh["hq"] % sh["hkv"]:
            _fail(name, f"{at}.hkv", f"must divide hq ({sh['hq']}), got {sh['hkv']}")
        out.append(tuple(sorted(sh.items())))
    if len(set(out)) != len(out):
        _fail(name, "shape", "lists a shape twice")
    return tuple(out)


def load_table(path: str) -> TuningTable:
    """Read and validate one table file (``ValueError`` naming the file on bad JSON or a bad field)."""
    name = os.path.basename(path)
    with open(path) as f:
        try:
            obj = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"decode tuning table {name}: not valid JSON: {e}") from e
    return validate_table(obj, name)


@functools.lru_cache(maxsize=None)
def shipped_tables(table_dir: str = TABLE_DIR) -> tuple[TuningTable, ...]:
    """Every ``*.json`` table in ``table_dir`` (default: the package's), validated, by file name; read once."""
    if not os.path.isdir(table_dir):
        return ()
    return tuple(load_table(os.path.join(table_dir, f)) for f in sorted(os.listdir(table_dir)) if f.endswith(".json"))


def table_for(device_kind: str, tables: Optional[tuple[TuningTable, ...]] = None) -> Optional[TuningTable]:
    """The table measured on ``device_kind`` (exact match of ``jax.devices()[0].device_kind``), or None."""
    for t in shipped_tables() if tables is None else tables:
        if t.device_kind == device_kind:
            return t
    return None


def _pick(entries: list[TuningEntry], capacity_rows: int) -> TuningEntry:
    """The entry of the largest measured T <= ``capacity_rows``, else the one of the smallest T."""
    below = [e for e in entries if e.T <= capacity_rows]
    return max(below, key=lambda e: e.T) if below else min(entries, key=lambda e: e.T)


def choose(device_kind: str, payload: str, head_dim: int, group: int, capacity_rows: int,
           table: Optional[TuningTable] = None, fallback: str = "mgpu") -> tuple[str, dict[str, Any], str]:
    """``(impl, config fields, reason)`` for one layer: ``impl`` "mgpu" (v1), "mgpu_ws" or "triton"; the fields
    build its config (``IMPLS[impl](**fields)``; empty: the kernel's defaults); ``reason`` says which table point
    decided.

    ``device_kind``: ``jax.devices()[0].device_kind``; ``payload``: the KV payload ("int8", "int4", ...);
    ``head_dim``: D; ``group``: query heads per KV head; ``capacity_rows``: the layer's rows (tokens).  ``table``:
    None -> the shipped table of ``device_kind`` (:func:`table_for`).  ``fallback``: the impl (default config)
    when nothing was measured for this layer: "mgpu" (v1) or "triton".
    """
    if fallback not in ("mgpu", "triton"):
        raise ValueError(f"fallback must be 'mgpu' or 'triton', got {fallback!r}")
    dflt = "v1 default" if fallback == "mgpu" else "the Triton kernel"
    table = table if table is not None else table_for(device_kind)
    if table is None:
        return fallback, {}, f"no table entry: no decode tuning table for {device_kind!r}: {dflt}"
    if table.device_kind != device_kind:
        return fallback, {}, (f"no table entry: table {table.name} is for {table.device_kind!r}, not "
                               f"{device_kind!r}: {dflt}")
    here = [e for e in table.entries if (e.format, e.head_dim, e.group) == (payload, head_dim, group)]
    if not here:
        return fallback, {}, f"no table entry in {table.name} for {payload} D={head_dim} G={group}: {dflt}"
    e = _pick(here, capacity_rows)
    at = f"at T={e.T}" + ("" if e.T == capacity_rows else f" (capacity {capacity_rows})")
    if e.impl == "mgpu" and e.variant == "default":
        why = f"table {table.name}: v1 {e.variant} {e.us:.1f} µs, fastest of {e.candidates} measured {at}"
    else:
        label = {"mgpu_ws": e.variant, "mgpu": f"v1 {e.variant}"}.get(e.impl, f"{e.impl} {e.variant}")
        why = f"table {table.name}: {label} {e.us:.1f} µs vs v1 default {e.v1_us:.1f} µs {at}"
    return e.impl, e.config_fields(), why
