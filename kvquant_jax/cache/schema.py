"""The cache ABI: every field that decides how stored K/V bytes are interpreted (design notes 0x05C, 0x05E).

A ``CacheSchema`` is frozen and hashable, so it is static metadata of a state pytree and a ``jit`` static argument.
Reusing a cache, a prefix or a calibration artifact goes through :func:`check_compatible`, which lists every
differing field instead of answering a bare yes/no.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

# payload formats: "fp32" | "bf16" | "fp16" | "int8" | "int4" | "int3" | "int2" | "uint4" | "e4m3" | "e5m2" | "nuq4" ...
PAYLOADS_FLOAT = ("fp32", "bf16", "fp16")
PAYLOADS_FP8 = ("e4m3", "e5m2")


@dataclasses.dataclass(frozen=True)
class TensorFormat:
    """How one of K or V is stored.

    Attributes:
      payload: element format ("fp16", "int4", "e4m3", "nuq3", ...).
      signed: True for a signed (symmetric, zero-free) integer alphabet; False for unsigned codes with a zero-point.
      zero: zero convention: "none" (symmetric), "int" (integer zero-point), "float" (floating offset, QServe),
        "min" (KIVI-style min as zero: x = code*scale + min).
      axis: quantization axis of a scale group: "tensor", "head", "token", "channel".
      group_size: elements per group along the grouped axis (0: the whole axis). For axis="channel" it is the number
        of tokens a per-channel group spans (KIVI's G); for axis="token" the head_dim elements sharing one scale.
      qparam_dtype: "fp16" | "fp32" | "bf16" | "none".
      qparam_order: how qparams are laid out next to codes, e.g. "scale,zero".
    """

    payload: str = "fp32"
    signed: bool = True
    zero: str = "none"
    axis: str = "token"
    group_size: int = 0
    qparam_dtype: str = "none"
    qparam_order: str = "scale"

    @property
    def bits(self) -> int:
        p = self.payload
        if p in ("fp32",):
            return 32
        if p in ("bf16", "fp16"):
            return 16
        if p in PAYLOADS_FP8:
            return 8
        digits = "".join(ch for ch in p if ch.isdigit())
        if not digits:
            raise ValueError(f"unknown payload format {p!r}")
        return int(digits)


@dataclasses.dataclass(frozen=True)
class CacheSchema:
    """Full ABI of one layer's cached representation.

    Attributes:
      scheme: family name ("full", "fp8", "per_token", "qserve", "kivi", "kvquant", ...).
      key, value: per-tensor formats.
      residual: number of full-precision recent rows (0: none).
      residual_rule: closure rule of the residual window: "none", "kivi" (K closes a whole R-chunk, V rolls one row),
        "synchronized" (K and V close together in G-aligned chunks).
      residual_dtype: dtype of full-precision residual / sink rows.
      sink: number of leading rows kept in full precision (attention sink / prefix rows).
      key_stage: "post_rope" or "pre_rope".
      rope_theta: RoPE base; rope_pairing: "half_split" (i <-> i + d/2) or "interleaved" (2i <-> 2i+1).
      layout_version: version of the packing/physical layout (bump on any byte-layout change).
      kernel_family: attention consumer family ("reference", "pallas_decode_v1", ...).
      calibration_id: identity of the calibration artifact behind static qparams, or "uncalibrated".
      model_id / tokenizer_hash: identity of what produced the rows ("" when not bound yet).
      extra: sorted tuple of (key, value) string pairs for scheme-specific fields (sparse outliers, codebooks).
    """

    scheme: str = "full"
    key: TensorFormat = TensorFormat()
    value: TensorFormat = TensorFormat()
    residual: int = 0
    residual_rule: str = "none"
    residual_dtype: str = "fp32"
    sink: int = 0
    key_stage: str = "post_rope"
    rope_theta: float = 10000.0
    rope_pairing: str = "half_split"
    layout_version: int = 1
    kernel_family: str = "reference"
    calibration_id: str = "uncalibrated"
    model_id: str = ""
    tokenizer_hash: str = ""
    extra: tuple = ()

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["extra"] = [list(p) for p in self.extra]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CacheSchema":
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown CacheSchema fields: {sorted(unknown)}")
        for name in ("key", "value"):
            if name in d and isinstance(d[name], dict):
                d[name] = TensorFormat(**d[name])
        if "extra" in d:
            d["extra"] = tuple(tuple(p) for p in d["extra"])
        return cls(**d)

    @classmethod
    def from_json(cls, s: str) -> "CacheSchema":
        return cls.from_dict(json.loads(s))


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


@dataclasses.dataclass(frozen=True)
class Compatibility:
    """Result of :func:`check_compatible`: ``ok`` and the differing fields as ``(field, a, b)`` triples."""

    differences: tuple

    @property
    def ok(self) -> bool:
        return not self.differences

    def __bool__(self) -> bool:
        return self.ok

    def describe(self) -> str:
        if self.ok:
            return "compatible"
        return "; ".join(f"{f}: {a!r} != {b!r}" for f, a, b in self.differences)


class IncompatibleSchemaError(ValueError):
    """Raised when a cache, prefix or artifact is reused under a different schema."""

    def __init__(self, what: str, compat: Compatibility):
        super().__init__(f"{what}: incompatible schema ({compat.describe()})")
        self.compatibility = compat


def _as_dict(x) -> dict[str, Any]:
    if isinstance(x, CacheSchema):
        return x.to_dict()
    if hasattr(x, "schema") and isinstance(x.schema, CacheSchema):
        return x.schema.to_dict()
    if isinstance(x, dict):
        return x
    raise TypeError(f"cannot compare schema of {type(x).__name__}")


def check_compatible(a, b, *, ignore: tuple[str, ...] = ()) -> Compatibility:
    """Compare two schemas (or objects with a ``.schema``, or schema dicts); list every differing field."""
    fa, fb = _flatten(_as_dict(a)), _flatten(_as_dict(b))
    diffs = []
    for key in sorted(set(fa) | set(fb)):
        if any(key == i or key.startswith(i + ".") for i in ignore):
            continue
        va, vb = fa.get(key, "<absent>"), fb.get(key, "<absent>")
        if va != vb:
            diffs.append((key, va, vb))
    return Compatibility(tuple(diffs))


def require_compatible(a, b, what: str = "cache reuse", **kw) -> None:
    """Raise :class:`IncompatibleSchemaError` naming every differing field."""
    c = check_compatible(a, b, **kw)
    if not c.ok:
        raise IncompatibleSchemaError(what, c)
