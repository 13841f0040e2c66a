"""Static-scale symmetric INTb cache (per-tensor or per-KV-head calibrated scales), and per-token INT3.

Static KV quantization (the PrefixQuant setting, design notes 0x08): one scale per layer for K and one for V (or one
per KV head), fitted offline on calibration rows and frozen, so an append needs no live reduction::

    q = clip(rint(x / s), -qmax, qmax)      (qmax = 2^(b-1) - 1; float32 arithmetic; values beyond qmax*s saturate)
    u = q + 2^(b-1)                         stored offset-binary, packed little-endian along head_dim
    x_hat = (u - 2^(b-1)) * s

Layout (``layout_version`` 1): ``k_codes, v_codes: uint8 [B, Hkv, C, ceil(D*b/8)]``; ``k_scale, v_scale: float32
[Hkv]`` with NO batch axis (shared by every sequence, like FP8's scales; a per-tensor scale is broadcast to every
head).  The scales are state set once by :func:`load_static_scales` before any body row is appended (changing them
later would reinterpret stored codes).  The calibration population is the caller's: with a prefix
(:mod:`kvquant_jax.cache.prefix`) the prefix rows are full precision and must be excluded from it (0x07E / 0x08C);
``kvquant_jax.calibration.prefixquant.static_kv_scales`` does that.

:class:`PerTokenAnyBitsScheme` is :class:`~kvquant_jax.cache.per_token.PerTokenScheme` with any width in 2..8
(e.g. INT3: 64 x 3 bits = 24 whole bytes per row); the per-token scheme itself admits 2, 4 and 8 only.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvquant_jax.cache import _rows, checks
from kvquant_jax.cache.interface import BATCH, HEADS, HEADS_REPLICATED, KVCache, SchemeBase, rows_finite
from kvquant_jax.cache.per_token import QPARAM_DTYPES, PerTokenLayerState, PerTokenScheme, check_packable
from kvquant_jax.cache.schema import CacheSchema, TensorFormat
from kvquant_jax.quant.packing import from_offset_binary, pack_bits, packed_length, to_offset_binary, unpack_bits

SCALE_AXES = ("tensor", "head")


@struct.dataclass
class StaticIntLayerState:
    """Codes ``uint8 [B, Hkv, C, ceil(D*bits/8)]``; scales ``float32 [Hkv]`` (no batch axis)."""

    k_codes: jax.Array
    v_codes: jax.Array
    k_scale: jax.Array
    v_scale: jax.Array


@dataclasses.dataclass(frozen=True)
class StaticIntScheme(SchemeBase):
    """Symmetric INTb K/V with static (calibrated) scales per tensor or per KV head.

    Attributes:
      bits: 2..8.
      scale_axis: "tensor" (one K and one V scale per layer) or "head" (one per KV head).
      calibration_id: identity of the scale artifact ("uncalibrated": every scale is 1.0).
    """

    family = "static_int"

    def supports_window_append(self) -> bool:
        """Positions enter the append only as row indices: the default shifted window append is exact."""
        return True

    presets = {"static_int8": {"bits": 8}, "static_int4": {"bits": 4}, "static_int2": {"bits": 2}}
    aliases = {"axis": ("scale_axis",)}
    unbatched_fields = ("k_scale", "v_scale")

    bits: int = 4
    scale_axis: str = "tensor"
    calibration_id: str = "uncalibrated"

    def __post_init__(self):
        if not 2 <= self.bits <= 8:
            raise ValueError(f"static_int: bits must lie in [2, 8], got {self.bits!r}")
        if self.scale_axis not in SCALE_AXES:
            raise ValueError(f"static_int: scale_axis must be one of {SCALE_AXES}, got {self.scale_axis!r}")
        if not self.calibration_id:
            raise ValueError("static_int: calibration_id must name the scale artifact (or be 'uncalibrated')")
        self._check_identity()

    @property
    def schema(self) -> CacheSchema:
        fmt = TensorFormat(payload=f"int{self.bits}", signed=True, zero="none", axis=self.scale_axis,
                           qparam_dtype="fp32", qparam_order="scale")
        return CacheSchema(scheme="static_int", key=fmt, value=fmt, residual_dtype="none",
                           calibration_id=self.calibration_id, extra=(("scale_source", "static"),),
                           **self._identity())

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def init_layer(self, batch, capacity, num_kv_heads, head_dim):
        codes = jnp.zeros((batch, num_kv_heads, capacity, packed_length(head_dim, self.bits)), jnp.uint8)
        one = jnp.ones((num_kv_heads,), jnp.float32)
        return StaticIntLayerState(k_codes=codes, v_codes=codes, k_scale=one, v_scale=one)

    def _encode(self, x, scale):
        """x ``[B, H, T, D]`` float, scale ``[H]`` -> packed codes."""
        q = jnp.clip(jnp.rint(x.astype(jnp.float32) / scale[None, :, None, None]), -self.qmax, self.qmax)
        return pack_bits(to_offset_binary(q.astype(jnp.int8), self.bits), self.bits, axis=-1)

    def _decode(self, codes, scale, head_dim):
        u = unpack_bits(codes, self.bits, axis=-1, count=head_dim)
        return from_offset_binary(u, self.bits).astype(jnp.float32) * scale[None, :, None, None]

    def append_layer(self, state, lengths, k, v, num_new):
        t = k.shape[1]
        mask = _rows.new_row_mask(num_new, t)
        pos = lengths[:, None] + _rows.arange_rows(t)[None, :]
        return state.replace(
            k_codes=_rows.write_rows(state.k_codes, self._encode(_rows.head_major(k), state.k_scale), pos, mask),
            v_codes=_rows.write_rows(state.v_codes, self._encode(_rows.head_major(v), state.v_scale), pos, mask))

    def append_layer_with_status(self, state, lengths, k, v, num_new):
        return self.append_layer(state, lengths, k, v, num_new), rows_finite(k, v, num_new)

    def field_axes(self, state):
        """Codes ``[B, Hkv, C, Db]``; static scales ``[Hkv]``: per KV head (sharded with the heads) or per tensor
        (replicated on every shard)."""
        scale = (HEADS,) if self.scale_axis == "head" else (HEADS_REPLICATED,)
        return {"k_codes": (BATCH, HEADS, None, None), "v_codes": (BATCH, HEADS, None, None),
                "k_scale": scale, "v_scale": scale}

    def materialize_layer(self, state, lengths):
        return _rows.materialize_packed(state, lengths, self.bits, self._decode)

    def validate_layer(self, state, lengths):
        half = 2 ** (self.bits - 1)
        for name, codes, scale in (("K", state.k_codes, state.k_scale), ("V", state.v_codes, state.v_scale)):
            checks.static_scales(f"static_int {name}", scale, per_tensor=self.scale_axis == "tensor",
                                 uncalibrated=self.calibration_id == "uncalibrated")
            u = unpack_bits(codes, self.bits, axis=-1)
            checks.codes_in_range(f"static_int {name} codes", u, lengths, half - self.qmax, half + self.qmax)

    def layer_nbytes(self, state):
        return _rows.packed_layer_nbytes(state)

    def decode_regions(self, state, lengths):
        """One region of packed symmetric codes with static per-head scales (the materialize view for odd widths)."""
        return (_rows.packed_decode_regions(state, lengths, self.bits, "head")
                or super().decode_regions(state, lengths))

    def ledger_layer(self, batch, heads, head_dim, rows, *, logical, capacity):
        out = {}
        for t in "kv":
            out[("codes", t)] = batch * heads * rows * packed_length(head_dim, self.bits)
            out[("qparams", t)] = heads * 4                               # float32 [Hkv] per tensor, unbatched
        return out


def load_static_scales(cache: KVCache, k_scales, v_scales) -> KVCache:
    """Set the per-layer scales of every static-INT layer of ``cache`` (plain, or the body of a prefix scheme).

    ``k_scales, v_scales``: ``[L]`` (per tensor) or ``[L, Hkv]`` indexed by GLOBAL layer.  Raises ``ValueError`` if
    a static layer already holds body rows (prefix rows are full precision and do not count), a value is not a
    finite positive normal float32, or the shapes do not fit.
    """
    ks, vs = np.asarray(k_scales, np.float32), np.asarray(v_scales, np.float32)
    lengths = _rows.host(cache.lengths).astype(np.int64)
    groups = list(cache.groups)
    for g, (scheme, first, n) in enumerate(cache.schemes):
        base = getattr(scheme, "body", scheme)
        if not isinstance(base, StaticIntScheme):
            continue
        if (lengths - getattr(scheme, "prefix_len", 0) > 0).any():
            raise ValueError("load_static_scales: the cache already holds body rows; scales must be set before the "
                             "first body append (changing them would reinterpret stored codes)")
        h = groups[g].k_scale.shape[-1]
        new = {}
        for name, arr in (("k_scale", ks), ("v_scale", vs)):
            sel = arr[first:first + n]
            if sel.shape[0] != n:
                raise ValueError(f"load_static_scales: {name} has {arr.shape[0]} layers, need {first + n}")
            sel = sel.reshape(n, -1)
            if base.scale_axis == "tensor" and sel.shape[1] != 1:
                raise ValueError(f"load_static_scales: a per-tensor scheme needs one {name} per layer")
            if sel.shape[1] not in (1, h):
                raise ValueError(f"load_static_scales: {name} has {sel.shape[1]} values per layer for {h} KV heads")
            if not (np.isfinite(sel).all() and (sel >= np.finfo(np.float32).tiny).all()):
                raise ValueError(f"load_static_scales: {name} must be finite, positive and normal")
            new[name] = jnp.asarray(np.broadcast_to(sel, (n, h)).copy())
        groups[g] = groups[g].replace(**new)
    return cache.replace(groups=tuple(groups))


@dataclasses.dataclass(frozen=True)
class PerTokenAnyBitsScheme(PerTokenScheme):
    """Per-token symmetric INTb for any ``bits`` in 2..8 (same layout and semantics as ``PerTokenScheme``)."""

    family = "per_token_any"
    presets = {"int3": {"bits": 3}, "int5": {"bits": 5}, "int6": {"bits": 6}, "int7": {"bits": 7}}

    def __post_init__(self):
        if not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            raise ValueError(f"per_token: bits must lie in [2, 8], got {self.bits!r}")
        if self.group_size < 0:
            raise ValueError(f"per_token: group_size must be >= 0, got {self.group_size}")
        self._check_identity()

    def init_layer(self, batch, capacity, num_kv_heads, head_dim):
        if self.bits in (2, 4, 8):
            return super().init_layer(batch, capacity, num_kv_heads, head_dim)
        g = check_packable(head_dim, self.bits, self.group_size, "per_token")
        # odd widths straddle bytes, so an empty slot is simply zero bytes (invisible rows are unspecified)
        codes = jnp.zeros((batch, num_kv_heads, capacity, head_dim * self.bits // 8), jnp.uint8)
        scale = jnp.ones((batch, num_kv_heads, capacity, head_dim // g), QPARAM_DTYPES[self.qparam_dtype])
        return PerTokenLayerState(k_codes=codes, v_codes=codes, k_scale=scale, v_scale=scale)


def per_token_int(bits: int, **kw) -> PerTokenScheme:
    """Per-token INT``bits``: the owner's :class:`PerTokenScheme` for 2/4/8 bits, :class:`PerTokenAnyBitsScheme`
    otherwise."""
    return PerTokenScheme(bits=bits, **kw) if bits in (2, 4, 8) else PerTokenAnyBitsScheme(bits=bits, **kw)
