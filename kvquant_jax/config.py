"""Experiment configs: YAML files -> typed, frozen dataclasses, with inheritance, overrides and sweeps.

A config file is a mapping with the blocks below (every key optional; defaults are the dataclass defaults)::

    base: ../base.yaml            # str or list: files merged first (paths relative to this file), MaxText-style
    name: kivi-axes
    model:       {name: smollm2-135m, dtype: fp32, rope_pairing: half_split, reduction: fast, random: null}
    data:        {corpus: null, split: test, fallback: true, offset: 0, calibration_corpus: null, ...}
    cache:       {scheme: kivi2, full_precision_first: 0, full_precision_last: 0, layers: [...], ...}
    activation:  {enabled: false, prefill: w8a8, smooth_alpha: null, ...}  # W8A8 + smoothing
    calibration: {fp8_scales: null, kvquant: null, ...}        # artifact paths ("observe" for FP8 scales)
    tasks:       {ppl: {...}, serving_ppl: {...}, passkey: {...}, kv_error: {...}, agreement: {...}, bytes: {...}}
    sweep:       {name: ..., grid: {dotted.key: [values]}, zip: {dotted.key: [values], label: [...]}, points: [...]}

Merging: a child file's mappings merge key by key into its bases'; any other value (a list, a scalar, a scheme
string replacing a scheme mapping) replaces the base's value.

Overrides (``--set key=value``): dotted keys, YAML-parsed values (``--set cache.scheme.residual=32``,
``--set tasks.passkey.lengths=[1024,2048]``).  A dotted key that descends into a scheme given as a string
(``cache.scheme: kivi2``) first turns it into a mapping (``{name: kivi2}``).

Sweeps: the points are the cartesian product of the ``grid`` axes (first axis slowest), times the ``zip`` axes
(all the same length, advanced together), times the explicit ``points`` list (each a mapping of dotted overrides).
The reserved key ``label`` (in ``zip`` or a point) names a point (grid values are appended to it); otherwise the
label is built from the values.  A point's overrides apply broader keys first (``cache.scheme`` before
``cache.scheme.bits``, whatever axis sets them); ``--set`` overrides apply last (the command line wins).

Every error is a :class:`ConfigError` that names the file the offending key came from and the dotted key.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import types
import typing
from pathlib import Path
from typing import Any, Callable

import yaml

from kvquant_jax.cache.registry import make_scheme, normalize_spec
from kvquant_jax.calibration.smoothquant import SITES
from kvquant_jax.models.w8a8 import LINEARS, W8A8Policy


class ConfigError(ValueError):
    """A config problem; the message starts with ``<file>: <dotted key>:``."""


# --------------------------------------------------------------------------------------------- typed blocks

@dataclasses.dataclass(frozen=True)
class RandomModelConfig:
    """A small random LLaMA (tests, smoke runs): byte-level tokenizer, no download."""

    num_layers: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    vocab_size: int = 320
    max_position: int = 4096
    rope_theta: float = 10000.0
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """``name``: a known model name (``smollm2-135m``), a ``.gguf`` file or a HF folder, or ``random``.
    ``reduction``: the projection numerics (``kvquant_jax.models.fixed_order``): "fast" (one XLA dot per
    projection) or "fixed_order" (results bit-identical for every mesh and batch size; slower; not with W8A8)."""

    name: str = "smollm2-135m"
    dtype: str = "fp32"
    rope_pairing: str = "half_split"
    reduction: str = "fast"
    random: RandomModelConfig | None = None


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """``corpus``: null (WikiText-2 ``split`` from ``$KVQ_DATA_DIR`` or ``../shared/data``, else the built-in text
    when ``fallback``), ``wikitext2`` (required), ``builtin``, or a text file.  ``offset``: tokens skipped at the
    start of the tokenized corpus.  ``calibration_*``: the text calibration artifacts are observed on (never the
    evaluation split)."""

    corpus: str | None = None
    split: str = "test"
    fallback: bool = True
    offset: int = 0
    calibration_corpus: str | None = None
    calibration_split: str = "validation"


@dataclasses.dataclass(frozen=True)
class SchemeSpec:
    """A cache scheme spec: a registry name plus overrides (``kvquant_jax.cache.registry.make_scheme``; the
    evaluation-only axis ablation ``kivi_axes`` is registered there like any other scheme)."""

    name: str
    options: tuple = ()          # sorted ((key, value), ...); lists frozen to tuples

    def to_spec(self) -> dict[str, Any]:
        return {"name": self.name, **{k: _thaw(v) for k, v in self.options}}

    def get(self, key: str, default=None):
        return dict(self.options).get(key, default)

    def __str__(self) -> str:
        if not self.options:
            return self.name
        return self.name + ":" + ",".join(f"{k}={json.dumps(_thaw(v))}" for k, v in self.options)


@dataclasses.dataclass(frozen=True)
class LayerRule:
    """``layers``: a layer index, a range string ``"a-b"`` (inclusive), a layer type ``"local"`` (sliding-window
    layers) / ``"global"`` (full-attention layers), or a list mixing them (``[local, 17]``); ``scheme``: the spec for
    them.  Layer types are resolved against the model (``eval.policy.build_policy``)."""

    layers: tuple[int | str, ...]
    scheme: SchemeSpec


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The K/V cache policy: ``scheme`` everywhere, then ``layers`` rules, then the full-precision layers
    (``full_precision_first`` / ``_last`` / ``_layers``, stored in ``full_precision_dtype``)."""

    scheme: SchemeSpec = SchemeSpec("fp32")
    full_precision_first: int = 0
    full_precision_last: int = 0
    full_precision_layers: tuple[int, ...] = ()
    full_precision_dtype: str = "fp32"
    layers: tuple[LayerRule, ...] = ()


@dataclasses.dataclass(frozen=True)
class ActivationConfig:
    """Projection precision and offline smoothing (``kvquant_jax.models.w8a8``, ``kvquant_jax.calibration``).

    ``enabled``: W8A8 live activations -- per-token symmetric INT8 activations x per-output-channel INT8 weights,
    int32 accumulation, float epilogue -- for the ``linears`` named (embeddings never; ``lm_head`` only if named).
    ``prefill`` / ``decode``: the path of T > 1 / T == 1 forwards ("w8a8", "w8a16" weight-only, "float").
    ``float_layers``: decoder layers kept in float.  ``impl``: "xla" int8 dot or the "pallas" kernel.
    ``fuse_norm``: W8A8 prefill quantizes each RMSNorm output once with the fused RMSNorm -> INT8 producer, shared
    by q/k/v (gate/up); False = float RMSNorm, then one activation quantization per projection.
    ``smooth_alpha``: SmoothQuant migration strength (None = off), folded into the RMSNorm / linear weights from
    ``smooth_windows`` x ``smooth_len`` tokens of the calibration split.  ``smooth_attention_alpha``: QServe's
    SmoothAttention (equal scales on each RoPE pair, folded into W_q / W_k; None = off) -- a float-exact
    transform that helps low-bit K caches, applied whether or not ``enabled`` is set.
    ``act_granularity`` / ``weight_granularity`` / ``act_symmetric`` / ``bits`` record the (only) supported
    format and are validated."""

    enabled: bool = False
    scheme: str = "w8a8"
    act_granularity: str = "per_token"
    weight_granularity: str = "per_channel"
    act_symmetric: bool = True
    bits: int = 8
    linears: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    prefill: str = "w8a8"
    decode: str = "w8a16"
    float_layers: tuple[int, ...] = ()
    impl: str = "xla"
    act_qparam_dtype: str = "fp32"
    fuse_norm: bool = True
    smooth_alpha: float | None = None
    smooth_sites: tuple[str, ...] = ("qkv", "gate_up")
    smooth_attention_alpha: float | None = None
    smooth_windows: int = 8
    smooth_len: int = 512

    def policy(self):
        """The :class:`~kvquant_jax.models.w8a8.W8A8Policy` of this block (None when not enabled)."""
        if not self.enabled:
            return None
        return W8A8Policy(linears=self.linears, prefill=self.prefill, decode=self.decode, impl=self.impl,
                          act_qparam_dtype=self.act_qparam_dtype, float_layers=self.float_layers,
                          fuse_norm=self.fuse_norm)

    @property
    def transforms_model(self) -> bool:
        return self.enabled or self.smooth_alpha is not None or self.smooth_attention_alpha is not None


@dataclasses.dataclass(frozen=True)
class CalibrationConfig:
    """Calibration artifacts.  ``fp8_scales``: a ``.npz`` with ``k_scale``/``v_scale`` ``[L]`` or ``[L, Hkv]``
    (and optionally ``calibration_id``), or ``observe``: per-layer absmax of exact K/V over ``observe_tokens``
    tokens of the calibration corpus at run time (saved next to the results)."""

    fp8_scales: str | None = None
    observe_tokens: int = 2048
    kvquant: str | None = None
    intactkv: str | None = None
    prefixquant: str | None = None


@dataclasses.dataclass(frozen=True)
class PplTask:
    """Fast perplexity: contiguous ``seq_len`` segments, chunked prefill through the cache (``chunk`` tokens per
    forward; ``chunk >= seq_len`` = one forward = exact attention, quantization unused)."""

    enabled: bool = True
    seq_len: int = 512
    max_segments: int = 2
    chunk: int = 128
    batch_size: int = 1


@dataclasses.dataclass(frozen=True)
class ServingPplTask:
    """Serving-path perplexity: prefill ``prefill`` tokens, then teacher-forced decode of ``decode`` tokens one at a
    time (forward with T=1); the ``decode`` predictions are scored."""

    enabled: bool = True
    prefill: int = 128
    decode: int = 128
    segments: int = 1
    attention: str = "reference"


@dataclasses.dataclass(frozen=True)
class PasskeyTask:
    """Passkey retrieval: a ``digits``-digit number at each depth of a filler context of each length (tokens);
    greedy decode of ``max_new_tokens``; ``trials`` keys per cell."""

    enabled: bool = False
    lengths: tuple[int, ...] = (1024,)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    trials: int = 1
    digits: int = 5
    max_new_tokens: int = 8
    batch_size: int = 5
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class KVErrorTask:
    """K/V reconstruction error and attention-logit / attention-output error vs full precision on exact K/V:
    ``seq_len`` tokens, the first ``prefill`` appended at once, the rest one decode append each; the attention of
    ``probes`` query positions in ``[prefill, seq_len]`` is compared."""

    enabled: bool = True
    seq_len: int = 256
    prefill: int = 128
    probes: int = 8
    position_bins: int = 32


@dataclasses.dataclass(frozen=True)
class AgreementTask:
    """Greedy-decode agreement with full precision: ``new_tokens`` greedy tokens after a ``prompt_tokens`` corpus
    prompt, free-running and teacher-forced on the full-precision continuation."""

    enabled: bool = True
    prompt_tokens: int = 64
    new_tokens: int = 128
    segments: int = 1


@dataclasses.dataclass(frozen=True)
class BytesTask:
    """Byte ledger (``kvquant_jax.quant.ledger``) and measured cache bytes of one request of ``length`` tokens."""

    enabled: bool = True
    length: int = 2048


@dataclasses.dataclass(frozen=True)
class TasksConfig:
    ppl: PplTask = PplTask()
    serving_ppl: ServingPplTask = ServingPplTask()
    passkey: PasskeyTask = PasskeyTask()
    kv_error: KVErrorTask = KVErrorTask()
    agreement: AgreementTask = AgreementTask()
    bytes: BytesTask = BytesTask()


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    """``grid`` / ``zip``: ordered ``((dotted_key, (values...)), ...)``; ``points``: tuple of override tuples;
    ``baseline``: the full-precision reference scheme of every delta."""

    name: str = ""
    grid: tuple = ()
    zip: tuple = ()
    points: tuple = ()
    baseline: SchemeSpec = SchemeSpec("fp32")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    name: str = ""
    description: str = ""
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    cache: CacheConfig = CacheConfig()
    activation: ActivationConfig = ActivationConfig()
    calibration: CalibrationConfig = CalibrationConfig()
    tasks: TasksConfig = TasksConfig()
    sweep: SweepConfig | None = None
    #: device mesh "data=D,model=M" for the whole run (kvquant_jax.sharding); not part of any row key: a mesh
    #: changes results only by float rounding (the sharded run is tested against the unsharded one)
    mesh: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (scheme specs as mappings); ``from_dict(to_dict())`` round-trips."""
        return _to_plain(self)

    def digest(self, *parts: str) -> str:
        """sha256 of the canonical JSON of the named top-level blocks (all but ``sweep`` when none named)."""
        d = self.to_dict()
        keys = parts or tuple(k for k in d if k != "sweep")
        return hashlib.sha256(json.dumps({k: d[k] for k in keys}, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------------------------- choices

CHOICES: dict[str, tuple] = {
    "model.dtype": ("fp32", "bf16", "fp16"),
    "model.rope_pairing": ("half_split", "interleaved"),
    "model.reduction": ("fast", "fixed_order"),
    "data.split": ("test", "validation"),
    "data.calibration_split": ("test", "validation"),
    "cache.full_precision_dtype": ("fp32", "bf16", "fp16"),
    "activation.scheme": ("w8a8",),
    "activation.act_granularity": ("per_token",),
    "activation.weight_granularity": ("per_channel",),
    "activation.bits": (8,),
    "activation.prefill": ("w8a8", "w8a16", "float"),
    "activation.decode": ("w8a8", "w8a16", "float"),
    "activation.impl": ("xla", "pallas"),
    "activation.act_qparam_dtype": ("fp32", "fp16"),
    "tasks.serving_ppl.attention": ("reference", "kernel", "auto"),
}
POSITIVE = {"model.random.num_layers", "model.random.hidden_size", "model.random.intermediate_size",
            "model.random.num_heads", "model.random.num_kv_heads", "model.random.head_dim",
            "model.random.vocab_size", "model.random.max_position", "calibration.observe_tokens",
            "tasks.ppl.max_segments", "tasks.ppl.chunk", "tasks.ppl.batch_size", "tasks.serving_ppl.prefill",
            "tasks.serving_ppl.decode", "tasks.serving_ppl.segments", "tasks.passkey.trials",
            "tasks.passkey.digits", "tasks.passkey.max_new_tokens", "tasks.passkey.batch_size",
            "tasks.kv_error.prefill", "tasks.kv_error.probes", "tasks.kv_error.position_bins",
            "tasks.agreement.prompt_tokens", "tasks.agreement.new_tokens", "tasks.agreement.segments",
            "tasks.bytes.length", "activation.smooth_windows", "activation.smooth_len"}
NON_NEGATIVE = {"data.offset", "cache.full_precision_first", "cache.full_precision_last"}
METRICS = ("ppl", "serving_ppl", "passkey", "kv_error", "agreement", "bytes")


# --------------------------------------------------------------------------------------------- loading

class _Origins:
    """Where each dotted key's value came from (a file, ``--set``, or a sweep point)."""

    def __init__(self, default: str):
        self.default = default
        self.map: dict[str, str] = {}

    def mark(self, data: Any, source: str, prefix: str = "") -> None:
        if prefix:
            self.map[prefix] = source
        if isinstance(data, dict):
            for k, v in data.items():
                self.mark(v, source, f"{prefix}.{k}" if prefix else str(k))

    def of(self, key: str) -> str:
        parts = key.split(".")
        for i in range(len(parts), 0, -1):
            src = self.map.get(".".join(parts[:i]))
            if src:
                return src
        return self.default

    def error(self, key: str, msg: str) -> ConfigError:
        return ConfigError(f"{self.of(key)}: {key}: {msg}")

    def copy(self) -> "_Origins":
        o = _Origins(self.default)
        o.map = dict(self.map)
        return o


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def _merge(base: dict, child: dict) -> dict:
    out = dict(base)
    for k, v in child.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _load_raw(path: Path, origins: _Origins, stack: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in stack:
        chain = " -> ".join(str(p) for p in stack + (path,))
        raise ConfigError(f"{path}: base: inheritance cycle ({chain})")
    data = _read_yaml(path)
    bases = data.pop("base", None)
    merged: dict = {}
    if bases is not None:
        if isinstance(bases, str):
            bases = [bases]
        if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
            raise ConfigError(f"{path}: base: must be a path or a list of paths, got {bases!r}")
        for b in bases:
            bp = (path.parent / b) if not Path(b).is_absolute() else Path(b)
            if not bp.is_file():
                raise ConfigError(f"{path}: base: file {b!r} not found (looked for {bp})")
            merged = _merge(merged, _load_raw(bp, origins, stack + (path,)))
    origins.mark(data, str(path))
    return _merge(merged, data)


def parse_overrides(items) -> list[tuple[str, Any]]:
    """``["a.b=1", ...]`` -> ``[("a.b", 1), ...]`` with YAML-parsed values."""
    out = []
    for item in items or ():
        key, eq, val = str(item).partition("=")
        key = key.strip()
        if not eq or not key:
            raise ConfigError(f"--set: {item!r} is not key=value")
        try:
            out.append((key, yaml.safe_load(val)))
        except yaml.YAMLError as e:
            raise ConfigError(f"--set: {key}: value {val!r} is not valid YAML: {e}") from None
    return out


def _scheme_as_mapping(v: Any) -> Any:
    if isinstance(v, str):
        return normalize_spec(v)
    return v


def set_dotted(raw: dict, key: str, value: Any, origins: _Origins | None = None, source: str = "--set") -> None:
    """Set ``raw[a][b][c] = value`` for ``key = "a.b.c"``, creating mappings on the way."""
    parts = key.split(".")
    if any(not p for p in parts):
        raise ConfigError(f"{source}: {key}: empty component in dotted key")
    node = raw
    for i, p in enumerate(parts[:-1]):
        here = ".".join(parts[: i + 1])
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
            if origins is not None:
                origins.map[here] = source
        elif here.endswith("scheme") and isinstance(nxt, str):
            nxt = node[p] = _scheme_as_mapping(nxt)
        elif not isinstance(nxt, dict):
            raise ConfigError(f"{source}: {key}: {here} is a {type(nxt).__name__} ({nxt!r}), not a mapping")
        node = nxt
    node[parts[-1]] = copy.deepcopy(value)
    if origins is not None:
        origins.mark(value, source, key)


# --------------------------------------------------------------------------------------------- typed parsing

def _freeze(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((str(k), _freeze(x)) for k, x in v.items()))
    return v


def _thaw(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_thaw(x) for x in v]
    return v


def _scheme_spec(v: Any, key: str, origins: _Origins) -> SchemeSpec:
    if isinstance(v, SchemeSpec):
        return v
    if isinstance(v, str):
        try:
            v = normalize_spec(v)
        except (ValueError, TypeError) as e:
            raise origins.error(key, str(e)) from None
    if not isinstance(v, dict):
        raise origins.error(key, f"a scheme spec must be a name or a mapping with 'name', got {v!r}")
    d = dict(v)
    if "scheme" in d and "name" not in d:
        d["name"] = d.pop("scheme")
    name = d.pop("name", None)
    if not isinstance(name, str) or not name:
        raise origins.error(key, f"a scheme mapping needs a 'name' (e.g. kivi2), got {v!r}")
    return SchemeSpec(name=name, options=tuple(sorted((str(k), _freeze(x)) for k, x in d.items())))


LAYER_TYPE_NAMES = ("local", "global")


def _layer_list(v: Any, key: str, origins: _Origins) -> tuple[int | str, ...]:
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,)
    if isinstance(v, str) and v.strip() in LAYER_TYPE_NAMES:
        return (v.strip(),)
    if isinstance(v, list) and v and all(isinstance(x, (int, str)) and not isinstance(x, bool) for x in v):
        if any(isinstance(x, str) for x in v):
            return tuple(y for i, x in enumerate(v) for y in _layer_list(x, f"{key}[{i}]", origins))
    if isinstance(v, str):
        a, dash, b = v.partition("-")
        try:
            lo, hi = int(a), int(b) if dash else int(a)
        except ValueError:
            raise origins.error(key, f"layer range must look like '2-5' (or a layer type 'local' / 'global'), "
                                     f"got {v!r}") from None
        if hi < lo:
            raise origins.error(key, f"empty layer range {v!r}")
        return tuple(range(lo, hi + 1))
    if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return tuple(v)
    raise origins.error(key, f"expected a layer index, a range 'a-b', a layer type ('local' / 'global') or a list "
                             f"of those, got {v!r}")


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _convert(tp, v: Any, key: str, origins: _Origins) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if v is None:
            if type(None) in args:
                return None
            raise origins.error(key, "must not be null")
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _convert(options[0], v, key, origins)
        for a in options:
            try:
                return _convert(a, v, key, origins)
            except ConfigError:
                pass
        raise origins.error(key, f"expected {' or '.join(_type_name(a) for a in options)}, got {v!r}")
    if tp is SchemeSpec:
        return _scheme_spec(v, key, origins)
    if dataclasses.is_dataclass(tp):
        if isinstance(v, tp):
            return v
        if v is None:
            v = {}
        if not isinstance(v, dict):
            raise origins.error(key, f"expected a mapping, got {v!r}")
        return _build(tp, v, key, origins)
    if origin is tuple:
        args = typing.get_args(tp)
        if isinstance(v, tuple):
            v = list(v)
        if not isinstance(v, list):
            raise origins.error(key, f"expected a list, got {v!r}")
        return tuple(_convert(args[0], x, f"{key}[{i}]", origins) for i, x in enumerate(v))
    if tp is bool:
        if not isinstance(v, bool):
            raise origins.error(key, f"expected true/false, got {v!r}")
        return v
    if tp is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise origins.error(key, f"expected an integer, got {v!r}")
        return v
    if tp is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise origins.error(key, f"expected a number, got {v!r}")
        return float(v)
    if tp is str:
        if not isinstance(v, str):
            raise origins.error(key, f"expected a string, got {v!r}")
        return v
    if tp is Any:
        return v
    raise TypeError(f"config: unsupported field type {tp!r} at {key}")  # a bug in this module


_SPECIAL = {"LayerRule", "SweepConfig"}


def _build(cls, data: dict, prefix: str, origins: _Origins):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for k in data:
        if k not in names:
            key = f"{prefix}.{k}" if prefix else str(k)
            raise origins.error(key, f"unknown key; allowed keys here: {', '.join(names)}")
    if cls is LayerRule:
        return _layer_rule(data, prefix, origins)
    if cls is SweepConfig:
        return _sweep(data, prefix, origins)
    kw = {}
    for name in names:
        if name in data:
            key = f"{prefix}.{name}" if prefix else name
            kw[name] = _convert(hints[name], data[name], key, origins)
    return cls(**kw)


def _layer_rule(data: dict, prefix: str, origins: _Origins) -> LayerRule:
    for req in ("layers", "scheme"):
        if req not in data:
            raise origins.error(f"{prefix}.{req}", "missing (a layer rule needs 'layers' and 'scheme')")
    return LayerRule(layers=_layer_list(data["layers"], f"{prefix}.layers", origins),
                     scheme=_scheme_spec(data["scheme"], f"{prefix}.scheme", origins))


def _axes(v: Any, key: str, origins: _Origins) -> tuple:
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise origins.error(key, f"expected a mapping of dotted keys to lists of values, got {v!r}")
    out = []
    for k, vals in v.items():
        if not isinstance(vals, list) or not vals:
            raise origins.error(f"{key}.{k}", f"expected a non-empty list of values, got {vals!r}")
        out.append((str(k), tuple(_freeze(x) for x in vals)))
    return tuple(out)


def _sweep(data: dict, prefix: str, origins: _Origins) -> SweepConfig:
    name = data.get("name", "")
    if not isinstance(name, str):
        raise origins.error(f"{prefix}.name", f"expected a string, got {name!r}")
    grid = _axes(data.get("grid"), f"{prefix}.grid", origins)
    zipped = _axes(data.get("zip"), f"{prefix}.zip", origins)
    lens = {k: len(v) for k, v in zipped}
    if len(set(lens.values())) > 1:
        raise origins.error(f"{prefix}.zip", f"zip axes must have the same length, got {lens}")
    pts = data.get("points") or []
    if not isinstance(pts, list) or not all(isinstance(p, dict) for p in pts):
        raise origins.error(f"{prefix}.points", f"expected a list of mappings of dotted overrides, got {pts!r}")
    points = tuple(tuple((str(k), _freeze(v)) for k, v in p.items()) for p in pts)
    baseline = _scheme_spec(data.get("baseline", "fp32"), f"{prefix}.baseline", origins)
    if not (grid or zipped or points):
        raise origins.error(prefix, "a sweep needs at least one of grid, zip, points")
    return SweepConfig(name=name, grid=grid, zip=zipped, points=points, baseline=baseline)


def _to_plain(obj: Any) -> Any:
    if isinstance(obj, SchemeSpec):
        return obj.to_spec()
    if isinstance(obj, SweepConfig):
        return {"name": obj.name, "grid": {k: [_thaw_spec(x) for x in v] for k, v in obj.grid},
                "zip": {k: [_thaw_spec(x) for x in v] for k, v in obj.zip},
                "points": [{k: _thaw_spec(v) for k, v in p} for p in obj.points],
                "baseline": obj.baseline.to_spec()}
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [_to_plain(x) for x in obj]
    return obj


def _thaw_spec(v: Any) -> Any:
    """Undo :func:`_freeze` for sweep values (mappings were frozen to sorted pair tuples)."""
    if isinstance(v, tuple) and v and all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)
                                          for x in v):
        return {k: _thaw_spec(x) for k, x in v}
    if isinstance(v, tuple):
        return [_thaw_spec(x) for x in v]
    return v


# --------------------------------------------------------------------------------------------- validation

def _check(cfg: ExperimentConfig, origins: _Origins) -> None:
    plain = cfg.to_dict()

    def walk(d, prefix=""):
        for k, v in d.items():
            key = f"{prefix}.{k}" if prefix else k
            if isinstance(v, dict) and key not in ("sweep",) and not key.endswith("scheme"):
                yield from walk(v, key)
            else:
                yield key, v

    for key, v in walk(plain):
        if key in CHOICES and v not in CHOICES[key]:
            raise origins.error(key, f"must be one of {list(CHOICES[key])}, got {v!r}")
        if key in POSITIVE and v < 1:
            raise origins.error(key, f"must be >= 1, got {v}")
        if key in NON_NEGATIVE and v < 0:
            raise origins.error(key, f"must be >= 0, got {v}")
    m = cfg.model
    if m.name != "random" and m.random is not None:
        raise origins.error("model.random", "only applies to model.name: random")
    if m.random is not None:
        r = m.random
        if r.num_heads % r.num_kv_heads:
            raise origins.error("model.random.num_heads", f"{r.num_heads} is not a multiple of num_kv_heads "
                                                          f"{r.num_kv_heads}")
        if r.head_dim % 2:
            raise origins.error("model.random.head_dim", f"must be even (RoPE pairs), got {r.head_dim}")
        if r.vocab_size < 259:
            raise origins.error("model.random.vocab_size", "must be >= 259 (byte-level tokenizer: 256 bytes + 3 "
                                                           "specials)")
    if cfg.data.split == cfg.data.calibration_split and (cfg.data.corpus or None) == cfg.data.calibration_corpus:
        raise origins.error("data.calibration_split", "calibration text must differ from the evaluation text")
    t = cfg.tasks
    if t.ppl.seq_len < 2:
        raise origins.error("tasks.ppl.seq_len", f"must be >= 2, got {t.ppl.seq_len}")
    if t.kv_error.prefill > t.kv_error.seq_len:
        raise origins.error("tasks.kv_error.prefill", f"{t.kv_error.prefill} exceeds tasks.kv_error.seq_len "
                                                      f"{t.kv_error.seq_len}")
    if t.kv_error.probes > t.kv_error.seq_len - t.kv_error.prefill + 1:
        raise origins.error("tasks.kv_error.probes", f"{t.kv_error.probes} probes but only "
                                                     f"{t.kv_error.seq_len - t.kv_error.prefill + 1} positions in "
                                                     f"[prefill, seq_len]")
    for i, d in enumerate(t.passkey.depths):
        if not 0.0 <= d <= 1.0:
            raise origins.error(f"tasks.passkey.depths[{i}]", f"depth must be in [0, 1], got {d}")
    for i, n in enumerate(t.passkey.lengths):
        if n < 64:
            raise origins.error(f"tasks.passkey.lengths[{i}]", f"context length must be >= 64 tokens, got {n}")
    if t.passkey.digits > 12:
        raise origins.error("tasks.passkey.digits", f"at most 12, got {t.passkey.digits}")
    a = cfg.activation
    if cfg.model.reduction == "fixed_order" and a.enabled:
        raise origins.error("model.reduction", "fixed_order replaces the projection hook; it does not combine with "
                                               "W8A8 (activation.enabled: true)")
    if a.smooth_alpha is not None and not 0.0 <= a.smooth_alpha <= 1.0:
        raise origins.error("activation.smooth_alpha", f"must be in [0, 1], got {a.smooth_alpha}")
    if a.smooth_attention_alpha is not None and not 0.0 <= a.smooth_attention_alpha <= 1.0:
        raise origins.error("activation.smooth_attention_alpha", f"must be in [0, 1], got {a.smooth_attention_alpha}")
    if not a.act_symmetric:
        raise origins.error("activation.act_symmetric", "only symmetric per-token INT8 activations are implemented")
    for i, n in enumerate(a.linears):
        if n not in LINEARS + ("lm_head",):
            raise origins.error(f"activation.linears[{i}]", f"unknown linear {n!r}; allowed {list(LINEARS)} + "
                                                           "['lm_head'] (embeddings are never quantized)")
    for i, n in enumerate(a.smooth_sites):
        if n not in SITES:
            raise origins.error(f"activation.smooth_sites[{i}]", f"unknown site {n!r}; allowed {list(SITES)}")
    for i, n in enumerate(a.float_layers):
        if n < 0:
            raise origins.error(f"activation.float_layers[{i}]", f"layer index must be >= 0, got {n}")
    if cfg.calibration.fp8_scales not in (None, "observe") and not cfg.calibration.fp8_scales.endswith(".npz"):
        raise origins.error("calibration.fp8_scales", f"expected 'observe' or a .npz path, got "
                                                      f"{cfg.calibration.fp8_scales!r}")
    # schemes: every spec must construct (catches e.g. KIVI residual not a multiple of the group size)
    check_specs(cfg, origins.error)


# schemes built from a calibration artifact: name -> (the config key naming the artifact, runtime options allowed)
ARTIFACT_SCHEMES: dict[str, tuple[str, frozenset]] = {
    "kvquant": ("calibration.kvquant", frozenset({"k_sparse_capacity", "kernel_family"})),
}


def _is_fp8_calibrated(spec: dict) -> bool:
    return str(spec.get("name", "")).startswith("fp8") and spec.get("scales", spec.get("scale")) == "calibrated"


def needs_artifact_scales(spec: dict) -> bool:
    """An FP8 spec with calibrated scales and no explicit ``k_scales``: its scales come from
    ``calibration.fp8_scales``."""
    return _is_fp8_calibrated(spec) and not spec.get("k_scales")


def _specs(cfg) -> list[tuple[str, dict]]:
    out = [("cache.scheme", cfg.cache.scheme.to_spec())]
    out += [(f"cache.layers[{i}].scheme", r.scheme.to_spec()) for i, r in enumerate(cfg.cache.layers)]
    if cfg.sweep is not None:
        out.append(("sweep.baseline", cfg.sweep.baseline.to_spec()))
    return out


def needs_kvquant_artifact(cfg) -> bool:
    return any(spec["name"] == "kvquant" for key, spec in _specs(cfg) if key != "sweep.baseline")


def needs_fp8_artifact(cfg) -> bool:
    """Some cache spec of ``cfg`` is FP8 with calibrated scales that come from ``calibration.fp8_scales``."""
    return any(needs_artifact_scales(spec) for key, spec in _specs(cfg) if key != "sweep.baseline")


def check_specs(cfg, error: Callable[[str, str], Exception]) -> None:
    """Construct every scheme spec of an ``ExperimentConfig``; raise ``error(key, message)`` on the first bad one."""
    for key, spec in _specs(cfg):
        if spec["name"] in ARTIFACT_SCHEMES:
            art_key, allowed = ARTIFACT_SCHEMES[spec["name"]]
            if getattr(cfg.calibration, art_key.split(".")[1]) is None:
                raise error(key, f"{spec['name']} is built from a calibration artifact: set {art_key}")
            bad = sorted(set(spec) - {"name"} - allowed)
            if bad:
                raise error(key, f"{spec['name']}: {bad} are fixed by the calibration artifact; only "
                                 f"{sorted(allowed)} may be set here")
            continue
        if needs_artifact_scales(spec):
            if cfg.calibration.fp8_scales is None:
                raise error(key, "fp8 scales='calibrated' needs calibration.fp8_scales (a scale artifact .npz, or "
                                 "'observe') or explicit k_scales / v_scales")
            spec = dict(spec, calibration_id=spec.get("calibration_id") or "pending")
        try:
            make_scheme(spec)
        except (ValueError, TypeError) as e:
            raise error(key, str(e)) from None
    for i, r in enumerate(cfg.cache.layers):
        if any(isinstance(x, int) and x < 0 for x in r.layers):
            raise error(f"cache.layers[{i}].layers", f"negative layer index in {list(r.layers)}")


PATH_KEYS = ("data.corpus", "data.calibration_corpus", "calibration.fp8_scales", "calibration.kvquant",
             "calibration.intactkv", "calibration.prefixquant")
NOT_PATHS = (None, "observe", "wikitext2", "builtin")


def _resolve_paths(cfg: ExperimentConfig, origins: _Origins) -> ExperimentConfig:
    """Relative file paths set in a config file are relative to that file's folder (like ``base:``); paths given
    with ``--set`` stay relative to the current directory.  Resolved paths are written relative to the current
    directory when they lie below it (so result keys do not depend on where the checkout is)."""
    d = cfg.to_dict()
    changed = False
    for key in PATH_KEYS:
        block, name = key.split(".")
        p = d[block][name]
        if p in NOT_PATHS or Path(p).is_absolute():
            continue
        src = origins.of(key).split(": sweep point ")[0]
        if src != "--set" and Path(src).is_file():
            full = (Path(src).parent / p).resolve()
            cwd = Path.cwd().resolve()
            d[block][name] = str(full.relative_to(cwd)) if full.is_relative_to(cwd) else str(full)
            changed = True
    return _build(ExperimentConfig, d, "", origins) if changed else cfg


def from_dict(raw: dict, *, source: str = "<dict>", origins: _Origins | None = None) -> ExperimentConfig:
    """Typed, validated config from a raw mapping (``source`` names it in errors)."""
    origins = origins or _Origins(source)
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    raw = dict(raw)
    raw.pop("base", None)
    cfg = _build(ExperimentConfig, raw, "", origins)
    if cfg.model.name == "random" and cfg.model.random is None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, random=RandomModelConfig()))
    _check(cfg, origins)
    return _resolve_paths(cfg, origins)


@dataclasses.dataclass(frozen=True)
class LoadedConfig:
    """A config file after inheritance and ``--set``: the typed base config plus what sweeps need."""

    config: ExperimentConfig
    path: str
    raw: dict                      # merged raw mapping (after --set), sweep block included
    overrides: tuple               # ((dotted_key, value), ...) from --set
    origins: Any
    sizes: str | None = None       # the size preset applied (name or file), None for the config's own sizes

    def points(self) -> list["Point"]:
        return sweep_points(self)


SIZE_PRESETS = {"cpu": "sweep_sizes.yaml", "gpu": "sweep_sizes_gpu.yaml"}


def size_preset_file(sizes: str, config_path: str | Path) -> Path:
    """The file of a size preset: a known name (:data:`SIZE_PRESETS`: ``cpu``, ``gpu``), found in the config's
    folder or the nearest parent folder holding it (``configs/``), or a path to a YAML file."""
    if sizes in SIZE_PRESETS:
        start = Path(config_path).resolve().parent
        for folder in (start, *start.parents):
            if (folder / SIZE_PRESETS[sizes]).is_file():
                return folder / SIZE_PRESETS[sizes]
        raise ConfigError(f"sizes: preset {sizes!r}: {SIZE_PRESETS[sizes]} not found in {start} or its parents")
    p = Path(sizes)
    if not p.is_file():
        raise ConfigError(f"sizes: {sizes!r} is neither a preset ({', '.join(SIZE_PRESETS)}) nor a file")
    return p


def apply_size_preset(raw: dict, preset: Path, origins: "_Origins") -> None:
    """Merge the preset's own ``tasks`` block (its ``base:`` is not followed) into ``raw``'s tasks, in place.

    A preset sets *sizes*: every task key but ``enabled`` (which metrics a config runs stays the config's choice).
    It applies after inheritance and before ``--set``, so the command line still wins."""
    data = _read_yaml(preset)
    extra = sorted(set(data) - {"base", "name", "tasks"})
    if extra:
        raise ConfigError(f"{preset}: a size preset holds only a tasks block, found {extra}")
    tasks = data.get("tasks") or {}
    if not isinstance(tasks, dict) or not all(isinstance(v, dict) for v in tasks.values()):
        raise ConfigError(f"{preset}: tasks: must map task names to mappings of sizes")
    sized = {t: {k: v for k, v in block.items() if k != "enabled"} for t, block in tasks.items()}
    origins.mark({"tasks": sized}, str(preset))
    raw["tasks"] = _merge(raw.get("tasks") or {}, sized)


def load_config(path: str | Path, overrides=(), sizes: str | None = None) -> LoadedConfig:
    """Load ``path`` (with ``base:`` inheritance), apply a size preset (``sizes``, else the config's ``sizes:``
    key; see :func:`apply_size_preset`) and ``--set`` overrides (strings ``k=v`` or pairs)."""
    path = Path(path)
    origins = _Origins(str(path))
    raw = _load_raw(path, origins)
    key_sizes = raw.pop("sizes", None)
    sizes = sizes if sizes is not None else key_sizes
    if sizes is not None:
        if not isinstance(sizes, str):
            raise ConfigError(f"{origins.of('sizes')}: sizes: must be a preset name or a file, got {sizes!r}")
        apply_size_preset(raw, size_preset_file(sizes, path), origins)
    pairs = [tuple(o) if isinstance(o, (tuple, list)) else parse_overrides([o])[0] for o in overrides]
    for k, v in pairs:
        set_dotted(raw, k, v, origins)
    cfg = from_dict(raw, source=str(path), origins=origins.copy())
    return LoadedConfig(config=cfg, path=str(path), raw=raw, overrides=tuple(pairs), origins=origins, sizes=sizes)


# --------------------------------------------------------------------------------------------- sweeps

@dataclasses.dataclass(frozen=True)
class Point:
    """One sweep point: its label, its overrides and the resolved config."""

    index: int
    label: str
    overrides: tuple               # ((dotted_key, value), ...)
    config: ExperimentConfig


def _short(key: str) -> str:
    parts = key.split(".")
    return parts[-2] if parts[-1] == "name" and len(parts) > 1 else parts[-1]


def _value_label(v: Any) -> str:
    v = _thaw_spec(v)
    if isinstance(v, dict):
        return str(_scheme_spec(v, "", _Origins("")))
    if isinstance(v, list):
        return "[" + ",".join(_value_label(x) for x in v) + "]"
    return str(v)


def sweep_points(loaded: LoadedConfig) -> list[Point]:
    """The resolved points of ``loaded`` (a single point when it has no ``sweep`` block)."""
    sw = loaded.config.sweep
    base_raw = {k: v for k, v in loaded.raw.items() if k != "sweep"}
    cmdline = [(k, v) for k, v in loaded.overrides if not k.startswith("sweep.") and k != "sweep"]
    if sw is None:
        return [Point(0, loaded.config.name or "base", (), dataclasses.replace(loaded.config, sweep=None))]
    grid_keys = [k for k, _ in sw.grid]
    combos = list(itertools.product(*[vals for _, vals in sw.grid])) if sw.grid else [()]
    n_zip = len(sw.zip[0][1]) if sw.zip else 1
    pts = sw.points or ((),)
    out, seen = [], {}
    for combo in combos:
        for zi in range(n_zip):
            for p in pts:
                named = [(k, vals[zi]) for k, vals in sw.zip] + list(p)
                labels = [str(v) for k, v in named if k == "label"]
                named = [(k, v) for k, v in named if k != "label"]
                grid_ov = list(zip(grid_keys, combo))
                parts = labels or [f"{_short(k)}={_value_label(v)}" for k, v in named]
                parts += [f"{_short(k)}={_value_label(v)}" for k, v in grid_ov]
                label = ", ".join(parts) or "base"
                # a broader key first, so "cache.scheme.bits" refines a whole "cache.scheme" set by another axis
                ovs = sorted(grid_ov + named, key=lambda kv: kv[0].count("."))
                idx = len(out)
                src = f"{loaded.path}: sweep point {idx} ({label})"
                origins = loaded.origins.copy()
                raw = copy.deepcopy(base_raw)
                for k, v in ovs:
                    set_dotted(raw, k, _thaw_spec(v), origins, source=src)
                for k, v in cmdline:
                    set_dotted(raw, k, v, origins)
                cfg = from_dict(raw, source=src, origins=origins)
                if label in seen:
                    raise ConfigError(f"{loaded.path}: sweep: points {seen[label]} and {idx} have the same label "
                                      f"{label!r}")
                seen[label] = idx
                out.append(Point(idx, label, tuple((k, _thaw_spec(v)) for k, v in ovs), cfg))
    return out
