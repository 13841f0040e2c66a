"""Scheme names and specs -> :class:`CacheScheme` objects (the config / CLI entry point).

``make_scheme(spec, *, rope_theta, rope_pairing)`` where ``spec`` is

* a name: "fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2", "qserve4", "kivi2", "kivi4";
* a name with inline overrides: ``"kivi2:residual=64,residual_rule=synchronized"``;
* a dict ``{"name": "kivi2", "residual": 64, ...}`` (``"scheme"`` is accepted for ``"name"``).

Override keys are the scheme's constructor fields plus the aliases below; an unknown key raises ``ValueError``
naming it and listing the allowed ones.  ``make_policy`` adds mixed per-layer policies (``full_precision_first``,
``full_precision_last``, ``full_precision_layers``, ``full_precision_dtype``).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from kvquant_jax.cache import mixed
from kvquant_jax.cache.fp8 import FP8Scheme
from kvquant_jax.cache.full import FullPrecisionScheme
from kvquant_jax.cache.interface import CacheScheme
from kvquant_jax.cache.kivi import KIVIScheme
from kvquant_jax.cache.per_token import PerTokenScheme
from kvquant_jax.cache.qserve import QServeScheme

FAMILIES: dict[str, type] = {
    "full": FullPrecisionScheme, "fp8": FP8Scheme, "per_token": PerTokenScheme, "qserve": QServeScheme,
    "kivi": KIVIScheme,
}

NAMES: dict[str, tuple[type, dict[str, Any]]] = {
    "fp32": (FullPrecisionScheme, {"dtype": "fp32"}),
    "bf16": (FullPrecisionScheme, {"dtype": "bf16"}),
    "fp16": (FullPrecisionScheme, {"dtype": "fp16"}),
    "fp8_e4m3": (FP8Scheme, {"fmt": "e4m3"}),
    "fp8_e5m2": (FP8Scheme, {"fmt": "e5m2"}),
    "int8": (PerTokenScheme, {"bits": 8}),
    "int4": (PerTokenScheme, {"bits": 4}),
    "int2": (PerTokenScheme, {"bits": 2}),
    "qserve4": (QServeScheme, {}),
    "kivi2": (KIVIScheme, {"k_bits": 2, "v_bits": 2}),
    "kivi4": (KIVIScheme, {"k_bits": 4, "v_bits": 4}),
}

# friendly aliases -> field names (per family)
ALIASES: dict[type, dict[str, tuple[str, ...]]] = {
    KIVIScheme: {"bits": ("k_bits", "v_bits"), "rule": ("residual_rule",), "k_group_size": ("group_size",),
                 "residual_length": ("residual",)},
    FP8Scheme: {"format": ("fmt",), "axis": ("scale_axis",), "scale": ("scales",)},
    PerTokenScheme: {"head_dim_group_size": ("group_size",)},
    FullPrecisionScheme: {},
    QServeScheme: {},
}

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


def _normalize(spec) -> dict[str, Any]:
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


def make_scheme(spec, *, rope_theta: float = 10000.0, rope_pairing: str = "half_split") -> CacheScheme:
    """Build one scheme from a name / inline string / dict (see module doc).  Raises ``ValueError`` naming an
    unknown scheme name or override key."""
    d = _normalize(spec)
    name = d.pop("name")
    if name not in NAMES:
        raise ValueError(f"unknown cache scheme {name!r}; known: {sorted(NAMES)}")
    cls, base = NAMES[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    aliases = ALIASES.get(cls, {})
    kwargs: dict[str, Any] = dict(base)
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
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"cache scheme {name!r}: {e}") from None


def make_policy(spec, num_layers: int, *, rope_theta: float = 10000.0,
                rope_pairing: str = "half_split") -> tuple[CacheScheme, ...]:
    """A per-layer policy: a scheme spec plus optional ``full_precision_first`` / ``full_precision_last`` /
    ``full_precision_layers`` (list) / ``full_precision_dtype`` keys (dict specs only)."""
    d = _normalize(spec)
    pol = {k: d.pop(k) for k in POLICY_KEYS if k in d}
    scheme = make_scheme(d, rope_theta=rope_theta, rope_pairing=rope_pairing)
    if not pol:
        return mixed.uniform(scheme, num_layers)
    return mixed.with_full_precision(scheme, num_layers, first=int(pol.get("full_precision_first", 0)),
                                     last=int(pol.get("full_precision_last", 0)),
                                     layers=tuple(pol.get("full_precision_layers", ())),
                                     dtype=pol.get("full_precision_dtype", "fp32"))


def scheme_from_config(config: dict[str, Any]) -> CacheScheme:
    """Inverse of ``scheme.config()`` (used by serialization)."""
    d = dict(config)
    family = d.pop("family", None)
    if family not in FAMILIES:
        raise ValueError(f"unknown scheme family {family!r}; known: {sorted(FAMILIES)}")
    cls = FAMILIES[family]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - fields
    if unknown:
        raise ValueError(f"scheme config for {family!r} has unknown fields {sorted(unknown)}")
    d = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    return cls(**d)


def ledger_from_config(config) -> str:
    """``kvq ledger CONFIG``: the byte-ledger table of a cache config.

    ``config``: a path to a YAML/JSON file, a dict, or a scheme name.  Keys: ``cache`` (a scheme spec, possibly
    with the ``make_policy`` keys) and the shape ``num_layers, batch, num_kv_heads, head_dim, length, capacity``
    (defaults: the design notes' GQA example, L=32, B=1, Hkv=8, d=128, T=C=4096).
    """
    from kvquant_jax.quant.ledger import LedgerShape, ledger_table

    if isinstance(config, str) and not config.endswith((".yaml", ".yml", ".json")):
        cfg: dict[str, Any] = {"cache": config}
    elif isinstance(config, str):
        with open(config) as f:
            if config.endswith(".json"):
                cfg = json.load(f)
            else:
                import yaml

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
