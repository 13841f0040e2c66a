"""Scheme names and specs -> :class:`CacheScheme` objects: the ONE registry (config, CLI, serialization, eval).

The registry is built from the scheme classes in :data:`SCHEME_CLASSES`: each class declares its ``family``
(serialization), its ``presets`` (names) and its ``aliases`` (friendly override keys), so adding a scheme is one
new file plus one entry here (docs/architecture.md, "Adding a scheme").

``make_scheme(spec, *, rope_theta, rope_pairing)`` where ``spec`` is

* a name (:data:`NAMES`): "fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2", "int3"...,
  "int8_vt", "int4_vt" (the same per-token codes in the Mosaic GPU kernel's transposed-V layout),
  "fp8_e4m3_vt", "fp8_e5m2_vt" (the FP8 codes and per-head scales in that layout),
  "int2_planar", "int4_planar", "qserve4_planar" (the per-token / QServe codes stored token-planar for the Mosaic
  GPU planar kernel),
  "static_int4", "qserve4", "kivi2", "kivi4", "kivi2_planar", "kivi4_planar" (the same KIVI codes stored
  token-planar for the Mosaic GPU KIVI kernel), "kvquant", "kivi_axes" (the simulated axis ablation), "prefix",
  "window" (a sliding-window ring around any body: ``{"name": "window", "window": 512, "body": "int4"}``),
  "kv" (K and V in different formats: ``{"name": "kv", "k": "int8", "v": "kivi2"}`` or ``"kv:k=int8,v=kivi2"``);
* a name with inline overrides: ``"kivi2:residual=64,residual_rule=synchronized"``;
* a dict ``{"name": "kivi2", "residual": 64, ...}`` (``"scheme"`` is accepted for ``"name"``).

Override keys are the scheme's constructor fields plus its aliases; an unknown key raises ``ValueError`` naming it
and listing the allowed ones.  A nested scheme field (the prefix wrapper's ``body``) takes any spec:
``{"name": "prefix", "prefix_len": 4, "body": "int4"}``.  ``make_policy`` adds mixed per-layer policies
(``full_precision_first``, ``full_precision_last``, ``full_precision_layers``, ``full_precision_dtype``).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import yaml

from kvquant_jax.cache import mixed
from kvquant_jax.cache.axis_ablation import AxisAblationScheme
from kvquant_jax.cache.fp8 import FP8Scheme
from kvquant_jax.cache.fp8_vt import FP8TransposedVScheme
from kvquant_jax.cache.full import FullPrecisionScheme
from kvquant_jax.cache.interface import CacheScheme
from kvquant_jax.cache.kivi import KIVIScheme
from kvquant_jax.cache.kivi_planar import KIVIPlanarScheme
from kvquant_jax.cache.kv_split import KVSplitScheme
from kvquant_jax.cache.kvquant import KVQuantScheme
from kvquant_jax.cache.per_token import PerTokenScheme
from kvquant_jax.cache.per_token_vt import TransposedVPerTokenScheme
from kvquant_jax.cache.prefix import PrefixScheme
from kvquant_jax.cache.qserve import QServeScheme
from kvquant_jax.cache.static_int import PerTokenAnyBitsScheme, StaticIntScheme
from kvquant_jax.cache.token_planar import QServePlanarScheme, TokenPlanarScheme
from kvquant_jax.cache.window import WindowScheme
from kvquant_jax.quant.ledger import LedgerShape, ledger_table

#: every registered scheme class (one entry per family)
SCHEME_CLASSES: tuple[type, ...] = (FullPrecisionScheme, FP8Scheme, FP8TransposedVScheme, PerTokenScheme,
                                    TransposedVPerTokenScheme, TokenPlanarScheme, QServePlanarScheme,
                                    PerTokenAnyBitsScheme, StaticIntScheme, QServeScheme, KIVIScheme, KIVIPlanarScheme,
                                    KVQuantScheme,
                                    PrefixScheme, AxisAblationScheme, WindowScheme, KVSplitScheme)


def _families(classes) -> dict[str, type]:
    out: dict[str, type] = {}
    for cls in classes:
        if not cls.family or cls.family in out:
            raise TypeError(f"registry: {cls.__name__} needs a unique family name, got {cls.family!r}")
        out[cls.family] = cls
    return out


def _names(classes) -> dict[str, tuple[type, dict[str, Any]]]:
    out: dict[str, tuple[type, dict[str, Any]]] = {}
    for cls in classes:
        for name, kwargs in cls.presets.items():
            if name in out:
                raise TypeError(f"registry: preset {name!r} is declared by {out[name][0].__name__} and "
                                f"{cls.__name__}")
            out[name] = (cls, dict(kwargs))
    return out


FAMILIES: dict[str, type] = _families(SCHEME_CLASSES)
NAMES: dict[str, tuple[type, dict[str, Any]]] = _names(SCHEME_CLASSES)
# friendly aliases -> field names (per class)
ALIASES: dict[type, dict[str, tuple[str, ...]]] = {cls: dict(cls.aliases) for cls in SCHEME_CLASSES}

POLICY_KEYS = ("full_precision_first", "full_precision_last", "full_precision_layers", "full_precision_dtype")


def _parse_inline(spec: str) -> dict[str, Any]:
    name, _, rest = spec.partition(":")
    out: dict[str, Any] = {"name": name.strip()}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, val = item.partition("=")
        if not eq:
            raise ValueError(f"cache spec {spec!r}: override {item!r} is not key=value")
        try:
            out[key.strip()] = json.loads(val)
        except json.JSONDecodeError:
            out[key.strip()] = val.strip()
    return out


def normalize_spec(spec) -> dict[str, Any]:
    """A spec (name, inline "name:k=v,...", or mapping with "name" / "scheme") as a mapping with "name"."""
    if isinstance(spec, CacheScheme):
        raise TypeError("make_scheme: already a CacheScheme")
    if isinstance(spec, str):
        return _parse_inline(spec)
    if isinstance(spec, dict):
        d = dict(spec)
        if "scheme" in d and "name" not in d:
            d["name"] = d.pop("scheme")
        if "name" not in d:
            raise ValueError(f"cache spec {spec!r} has no 'name'")
        return d
    raise TypeError(f"cache spec must be a str or dict, got {type(spec).__name__}")


def _rope_fields(cls) -> bool:
    return "rope_theta" in {f.name for f in dataclasses.fields(cls)}


def make_scheme(spec, *, rope_theta: float = 10000.0, rope_pairing: str = "half_split") -> CacheScheme:
    """Build one scheme from a name / inline string / dict (see module doc).  Raises ``ValueError`` naming an
    unknown scheme name or override key."""
    d = normalize_spec(spec)
    name = d.pop("name")
    if name not in NAMES:
        raise ValueError(f"unknown cache scheme {name!r}; known: {sorted(NAMES)}")
    cls, base = NAMES[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    aliases = ALIASES.get(cls, {})
    kwargs: dict[str, Any] = dict(base)
    if _rope_fields(cls):
        kwargs.update(rope_theta=rope_theta, rope_pairing=rope_pairing)
    for key, val in d.items():
        if key in aliases:
            for f in aliases[key]:
                kwargs[f] = val
        elif key in fields:
            kwargs[key] = val
        else:
            allowed = sorted((fields | set(aliases)) - {"rope_theta", "rope_pairing"})
            raise ValueError(f"cache scheme {name!r}: unknown key {key!r}; allowed: {allowed}")
    for f in ("k_scales", "v_scales"):
        if f in kwargs:
            kwargs[f] = tuple(kwargs[f]) if isinstance(kwargs[f], (list, tuple)) else (kwargs[f],)
    for f in cls.nested_fields:
        if f in kwargs and not isinstance(kwargs[f], CacheScheme):
            kwargs[f] = make_scheme(kwargs[f], rope_theta=rope_theta, rope_pairing=rope_pairing)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"cache scheme {name!r}: {e}") from None


def make_policy(spec, num_layers: int, *, rope_theta: float = 10000.0,
                rope_pairing: str = "half_split") -> tuple[CacheScheme, ...]:
    """A per-layer policy: a scheme spec plus optional ``full_precision_first`` / ``full_precision_last`` /
    ``full_precision_layers`` (list) / ``full_precision_dtype`` keys (dict specs only)."""
    d = normalize_spec(spec)
    pol = {k: d.pop(k) for k in POLICY_KEYS if k in d}
    scheme = make_scheme(d, rope_theta=rope_theta, rope_pairing=rope_pairing)
    if not pol:
        return mixed.uniform(scheme, num_layers)
    return mixed.with_full_precision(scheme, num_layers, first=int(pol.get("full_precision_first", 0)),
                                     last=int(pol.get("full_precision_last", 0)),
                                     layers=tuple(pol.get("full_precision_layers", ())),
                                     dtype=pol.get("full_precision_dtype", "fp32"))


def scheme_from_config(config: dict[str, Any]) -> CacheScheme:
    """Inverse of ``scheme.config()`` (used by serialization), for every family in :data:`FAMILIES` (nested
    scheme fields recurse)."""
    d = dict(config)
    family = d.pop("family", None)
    if family not in FAMILIES:
        raise ValueError(f"unknown scheme family {family!r}; known: {sorted(FAMILIES)}")
    cls = FAMILIES[family]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - fields
    if unknown:
        raise ValueError(f"scheme config for {family!r} has unknown fields {sorted(unknown)}")
    d = {k: scheme_from_config(v) if k in cls.nested_fields else tuple(v) if isinstance(v, list) else v
         for k, v in d.items()}
    return cls(**d)


def ledger_from_config(config) -> str:
    """``kvq ledger CONFIG``: the byte-ledger table of a cache config.

    ``config``: a path to a YAML/JSON file, a dict, or a scheme name.  Keys: ``cache`` (a scheme spec, possibly
    with the ``make_policy`` keys) and the shape ``num_layers, batch, num_kv_heads, head_dim, length, capacity``
    (defaults: the design notes' GQA example, L=32, B=1, Hkv=8, d=128, T=C=4096).
    """
    if isinstance(config, str) and not config.endswith((".yaml", ".yml", ".json")):
        cfg: dict[str, Any] = {"cache": config}
    elif isinstance(config, str):
        with open(config) as f:
            if config.endswith(".json"):
                cfg = json.load(f)
            else:
                cfg = yaml.safe_load(f)
    else:
        cfg = dict(config)
    cfg = dict(cfg)
    spec = cfg.pop("cache", cfg.pop("scheme", None))
    if spec is None:
        raise ValueError("ledger config needs a 'cache' scheme spec")
    shape_keys = ("num_layers", "batch", "num_kv_heads", "head_dim", "length", "capacity")
    unknown = set(cfg) - set(shape_keys) - {"rope_theta", "rope_pairing"}
    if unknown:
        raise ValueError(f"ledger config: unknown keys {sorted(unknown)}; allowed: cache, {', '.join(shape_keys)}")
    length = int(cfg.get("length", 4096))
    shape = LedgerShape(num_layers=int(cfg.get("num_layers", 32)), batch=int(cfg.get("batch", 1)),
                        num_kv_heads=int(cfg.get("num_kv_heads", 8)), head_dim=int(cfg.get("head_dim", 128)),
                        length=length, capacity=int(cfg.get("capacity", length)))
    policy = make_policy(spec, shape.num_layers, rope_theta=float(cfg.get("rope_theta", 10000.0)),
                         rope_pairing=cfg.get("rope_pairing", "half_split"))
    return ledger_table(policy, shape)
