"""The decode-attention operand ABI: explicit arrays in the documented physical layouts plus static formats.

A decode step attends one query token per sequence over a set of *regions*.  A region is a run of logical
positions whose K rows and V rows are each stored in one array (an :class:`KVOperand`), row ``i`` of the array
holding position ``i`` of the region's coordinate; rows ``[start[b], end[b])`` are live for sequence ``b``.
Regions are position-disjoint and together with the optional current token (``k_new, v_new``) they form the
key set of ONE softmax (design notes 0x06C): quantized history, full-precision residual/sink rows and the exact
K/V of the token the forward just produced compete in the same normalization.

Formats (``KVFormat``; layouts from docs/architecture.md, "Physical layouts")::

    payload   data                                   decoded x
    fp32/bf16/fp16  [B, Hkv, N, D] float             x = data
    e4m3/e5m2  [B, Hkv, N, D] float8                 x = float(data) * scale        scale "head": f32 [Hkv] or "none"
    int8/4/2/1  [B, Hkv, N, D*bits/8] uint8 packed     u = unpacked offset-binary code (element i at bit i*bits)
        scale "head":    f32 [Hkv] (static per-layer scales, symmetric only)
        scale "token":   [B, Hkv, N, D // G_d] (group = G_d elements along D, 0 = D)
        scale "channel": [B, Hkv, N // G, D]   (group = G tokens along the row axis; KIVI keys)
        zero "symmetric": x = (u - 2^(bits-1)) * s
        zero "offset":    x = (u - o) * s          o: same shape as s (QServe's floating offset)
        zero "min":       x = u * s + m            m: same shape as s (KIVI)

Per-(token, head) scale arrays without a trailing group axis (QServe's ``[B, Hkv, C]``) are passed as
``[..., C, 1]`` (a free reshape).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

FLOAT_PAYLOADS = ("fp32", "bf16", "fp16")
FP8_PAYLOADS = ("e4m3", "e5m2")
INT_PAYLOADS = ("int8", "int4", "int2", "int1")
PAYLOAD_BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "e4m3": 8, "e5m2": 8, "int8": 8, "int4": 4, "int2": 2,
                "int1": 1}
PAYLOAD_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16, "e4m3": jnp.float8_e4m3fn,
                  "e5m2": jnp.float8_e5m2}
SCALE_AXES = ("none", "head", "token", "channel")
ZERO_KINDS = ("none", "symmetric", "offset", "min")


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """Static description of how one of K/V of a region is stored (hashable: a static jit argument)."""

    payload: str
    scale: str = "none"
    zero: str = "none"
    group: int = 0

    def __post_init__(self):
        if self.payload not in PAYLOAD_BITS:
            raise ValueError(f"payload must be one of {sorted(PAYLOAD_BITS)}, got {self.payload!r}")
        if self.scale not in SCALE_AXES:
            raise ValueError(f"scale must be one of {SCALE_AXES}, got {self.scale!r}")
        if self.zero not in ZERO_KINDS:
            raise ValueError(f"zero must be one of {ZERO_KINDS}, got {self.zero!r}")
        if self.group < 0:
            raise ValueError(f"group must be >= 0, got {self.group}")
        if self.payload in FLOAT_PAYLOADS and (self.scale, self.zero) != ("none", "none"):
            raise ValueError(f"{self.payload} payload takes no scale/zero, got {self.scale}/{self.zero}")
        if self.payload in FP8_PAYLOADS and (self.scale not in ("none", "head") or self.zero != "none"):
            raise ValueError(f"{self.payload} payload takes scale 'none' or 'head' and no zero, "
                             f"got {self.scale}/{self.zero}")
        if self.is_int:
            if self.scale not in ("token", "channel", "head"):
                raise ValueError(f"{self.payload} payload needs scale 'token', 'channel' or 'head', "
                                 f"got {self.scale!r}")
            if self.scale == "head" and self.zero != "symmetric":
                raise ValueError(f"per-head static INT scales are symmetric, got zero={self.zero!r}")
            if self.zero not in ("symmetric", "offset", "min"):
                raise ValueError(f"{self.payload} payload needs zero 'symmetric', 'offset' or 'min', "
                                 f"got {self.zero!r}")
            if self.scale == "channel" and (self.group <= 0 or self.zero == "offset"):
                raise ValueError("scale 'channel' needs group = tokens per scale group (> 0) and zero "
                                 f"'symmetric' or 'min', got group={self.group}, zero={self.zero!r}")

    @property
    def bits(self) -> int:
        return PAYLOAD_BITS[self.payload]

    @property
    def is_int(self) -> bool:
        return self.payload in INT_PAYLOADS

    @property
    def codes_per_byte(self) -> int:
        """Codes packed in one byte (1 for every non-packed payload)."""
        return 8 // self.bits if self.is_int else 1

    @property
    def has_zero_array(self) -> bool:
        return self.zero in ("offset", "min")

    @property
    def has_scale_array(self) -> bool:
        return self.scale != "none"

    def data_dim(self, d: int) -> int:
        """Last-axis length of the data array for head dim ``d``."""
        return d * self.bits // 8 if self.is_int else d

    def token_groups(self, d: int) -> int:
        """Scale groups per row along D for scale 'token' (1 otherwise)."""
        if self.scale != "token" or self.group in (0, d):
            return 1
        return d // self.group

    def check_dims(self, d: int, what: str) -> None:
        if self.is_int and (d * self.bits) % 8:
            raise ValueError(f"{what}: head_dim {d} does not fill whole bytes at {self.bits} bits")
        if self.scale == "token" and self.group not in (0, d):
            if d % self.group or self.group % self.codes_per_byte:
                raise ValueError(f"{what}: token group {self.group} must divide head_dim {d} and be a multiple of "
                                 f"{self.codes_per_byte} (codes per byte)")


@struct.dataclass
class KVOperand:
    """One of K/V of a region: ``data`` plus optional ``scale`` / ``zero`` arrays, and the static format."""

    data: jax.Array
    scale: Optional[jax.Array] = None
    zero: Optional[jax.Array] = None
    fmt: KVFormat = struct.field(pytree_node=False, default=KVFormat("fp32"))


@struct.dataclass
class Region:
    """K/V operands of one run of positions; rows ``[start[b], end[b])`` are live (int32 ``[B]`` each)."""

    k: KVOperand
    v: KVOperand
    start: jax.Array
    end: jax.Array


def dense_operand(x: jax.Array) -> KVOperand:
    """A full-precision operand (fp32/bf16/fp16 data ``[B, Hkv, N, D]``)."""
    names = {jnp.dtype(v): k for k, v in PAYLOAD_DTYPES.items() if k in FLOAT_PAYLOADS}
    dt = jnp.dtype(x.dtype)
    if dt not in names:
        raise ValueError(f"dense operand must be fp32/bf16/fp16, got {dt}")
    return KVOperand(data=x, fmt=KVFormat(names[dt]))


def region(k: KVOperand, v: KVOperand, end, start=None) -> Region:
    """Region with live rows ``[start, end)`` (``start`` defaults to 0); ``end``/``start``: int ``[B]``."""
    end = jnp.asarray(end, jnp.int32)
    start = jnp.zeros_like(end) if start is None else jnp.asarray(start, jnp.int32)
    return Region(k=k, v=v, start=start, end=end)


def _expected_shapes(op: KVOperand, b: int, hkv: int, n: int, d: int):
    f = op.fmt
    data = (b, hkv, n, f.data_dim(d))
    if f.scale == "head":
        sc = (hkv,)
    elif f.scale == "token":
        sc = (b, hkv, n, f.token_groups(d))
    elif f.scale == "channel":
        sc = (b, hkv, n // f.group, d)
    else:
        sc = None
    return data, sc


def check_region(r: Region, batch: int, num_kv_heads: int, head_dim: int, what: str = "region") -> int:
    """Static checks of one region against ``(B, Hkv, D)``; returns its row count N.  Raises ``ValueError``."""
    for name, op in (("k", r.k), ("v", r.v)):
        f = op.fmt
        f.check_dims(head_dim, f"{what}.{name}")
        if op.data.ndim != 4:
            raise ValueError(f"{what}.{name}.data must be [B, Hkv, N, ...], got shape {op.data.shape}")
        n = op.data.shape[2]
        data_shape, scale_shape = _expected_shapes(op, batch, num_kv_heads, n, head_dim)
        if tuple(op.data.shape) != data_shape:
            raise ValueError(f"{what}.{name}.data: expected shape {data_shape} for {f}, got {op.data.shape}")
        want_dt = jnp.dtype(jnp.uint8) if f.is_int else jnp.dtype(PAYLOAD_DTYPES[f.payload])
        if jnp.dtype(op.data.dtype) != want_dt:
            raise ValueError(f"{what}.{name}.data: expected dtype {want_dt} for payload {f.payload}, "
                             f"got {op.data.dtype}")
        if f.scale == "channel" and n % f.group:
            raise ValueError(f"{what}.{name}: {n} rows is not a multiple of the channel group {f.group}")
        for arr_name, arr, needed in (("scale", op.scale, f.has_scale_array), ("zero", op.zero, f.has_zero_array)):
            if needed and arr is None:
                raise ValueError(f"{what}.{name}.{arr_name} is required for {f}")
            if not needed and arr is not None:
                raise ValueError(f"{what}.{name}.{arr_name} must be None for {f}")
            if needed and tuple(arr.shape) != scale_shape:
                raise ValueError(f"{what}.{name}.{arr_name}: expected shape {scale_shape}, got {arr.shape}")
            if needed and not jnp.issubdtype(arr.dtype, jnp.floating):
                raise ValueError(f"{what}.{name}.{arr_name} must be floating, got {arr.dtype}")
    nk, nv = r.k.data.shape[2], r.v.data.shape[2]
    if nk != nv:
        raise ValueError(f"{what}: K has {nk} rows but V has {nv}")
    for nm, a in (("start", r.start), ("end", r.end)):
        if tuple(a.shape) != (batch,) or not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{what}.{nm} must be int [B={batch}], got {a.dtype}{tuple(a.shape)}")
    return nk


def check_query(q, regions, k_new=None, v_new=None) -> tuple[int, int, int, int]:
    """Static checks of a decode call; returns ``(B, Hq, Hkv, D)``."""
    if q.ndim != 3:
        raise ValueError(f"q must be [B, Hq, D] (one new token), got shape {q.shape}")
    b, hq, d = q.shape
    if not regions and k_new is None:
        raise ValueError("decode attention needs at least one region or k_new/v_new")
    hkv = regions[0].k.data.shape[1] if regions else k_new.shape[1]
    if hq % hkv:
        raise ValueError(f"GQA needs Hq ({hq}) to be a multiple of Hkv ({hkv})")
    for i, r in enumerate(regions):
        check_region(r, b, hkv, d, f"regions[{i}]")
    if (k_new is None) != (v_new is None):
        raise ValueError("pass both k_new and v_new, or neither")
    if k_new is not None:
        for nm, a in (("k_new", k_new), ("v_new", v_new)):
            if tuple(a.shape) != (b, hkv, d):
                raise ValueError(f"{nm} must be [B, Hkv, D] = {(b, hkv, d)}, got {a.shape}")
    return b, hq, hkv, d
