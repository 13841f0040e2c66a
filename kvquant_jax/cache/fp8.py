"""FP8 cache (E4M3 / E5M2) with per-tensor or per-KV-head scales (design notes 0x0A, 0x0AA, 0x0AC).

``code = fp8(clip(x / scale, -max, max))`` (saturating, round to nearest even; ``kvquant_jax.quant.fp8``),
``x_hat = float(code) * scale``.

Scale sources (``scales=``, recorded in the schema: ``calibration_id`` and ``extra.scale_source``):

* ``"uncalibrated"``: every scale is 1.0 -- a representation choice, not a range fit (0x0AA).
* ``"warmup"``: the scales are observed from the first appended batch (``amax / fp8_max`` over that batch's valid
  rows, per tensor or per head; ``amax == 0`` gives 1.0) and then frozen.  The scale is *state*: it is written only
  while every committed length is 0 (then no stored row depends on it: the frontier rule), so "frozen" is a
  function of the committed lengths: the cache is warm iff it holds any row.  Truncating every sequence to 0
  therefore returns a cache equal to a fresh one (the next append warms up again); truncating to a positive length
  keeps the scale the surviving rows were encoded with.  The observation is :meth:`FP8Scheme.observe_shared`
  (from the layer's lengths), the encode :meth:`FP8Scheme.append_observed_with_status`: a window ring
  (``cache/window.py``) stores the scales once and observes them once per layer, so its blocks encode with the
  layer's first-append scales exactly as the unwindowed cache does.
* ``"calibrated"``: scales come from data: ``k_scales`` / ``v_scales`` on the scheme (one value per tensor, or one
  per KV head, same for every layer) or per layer through :func:`load_scales`.  ``calibration_id`` names the
  artifact and must be given.

Layout: ``k, v: [B, Hkv, C, D]`` float8_e4m3fn / float8_e5m2; ``k_scale, v_scale: float32 [Hkv]`` with NO batch
axis (one scale set per layer shared by every sequence; a per-tensor scale is broadcast to every head).
Layers a mixed policy skips stay full precision (:mod:`kvquant_jax.cache.mixed`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvquant_jax.abi.regions import KVFormat, KVOperand, region
from kvquant_jax.cache import _rows, checks
from kvquant_jax.cache._scales import layer_scale_table
from kvquant_jax.cache.shards import shard_any, shard_max
from kvquant_jax.cache.interface import BATCH, HEADS, HEADS_REPLICATED, KVCache, SchemeBase, rows_finite
from kvquant_jax.cache.schema import CacheSchema, TensorFormat
from kvquant_jax.quant.fp8 import dequantize_fp8, fp8_dtype, fp8_max, fp8_scale_from_absmax, quantize_fp8

SCALE_SOURCES = ("uncalibrated", "warmup", "calibrated")
SCALE_AXES = ("tensor", "head")


@struct.dataclass
class FP8LayerState:
    """k, v: fp8 ``[B, Hkv, C, D]``; k_scale, v_scale: float32 ``[Hkv]`` (unbatched)."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array
    v_scale: jax.Array


@dataclasses.dataclass(frozen=True)
class FP8Scheme(SchemeBase):
    """FP8 K/V with external scales.

    Attributes:
      fmt: "e4m3" or "e5m2".
      scales: "uncalibrated" (1.0), "warmup" (first batch, then frozen) or "calibrated" (given).
      scale_axis: "tensor" (one K and one V scale per layer) or "head" (one per KV head).
      k_scales, v_scales: calibrated values (tuple of 1 or Hkv floats) used by ``init_layer``; empty means 1.0
        until :func:`load_scales` sets per-layer values.
      calibration_id: identity of the scale artifact (required for "calibrated").
    """

    family = "fp8"
    presets = {"fp8_e4m3": {"fmt": "e4m3"}, "fp8_e5m2": {"fmt": "e5m2"}}
    aliases = {"format": ("fmt",), "axis": ("scale_axis",), "scale": ("scales",)}
    unbatched_fields = ("k_scale", "v_scale")

    fmt: str = "e4m3"
    scales: str = "uncalibrated"
    scale_axis: str = "tensor"
    k_scales: tuple = ()
    v_scales: tuple = ()
    calibration_id: str = ""

    def __post_init__(self):
        fp8_dtype(self.fmt)
        if self.scales not in SCALE_SOURCES:
            raise ValueError(f"fp8: scales must be one of {SCALE_SOURCES}, got {self.scales!r}")
        if self.scale_axis not in SCALE_AXES:
            raise ValueError(f"fp8: scale_axis must be one of {SCALE_AXES}, got {self.scale_axis!r}")
        object.__setattr__(self, "k_scales", tuple(float(x) for x in self.k_scales))
        object.__setattr__(self, "v_scales", tuple(float(x) for x in self.v_scales))
        if self.scales != "calibrated" and (self.k_scales or self.v_scales or self.calibration_id):
            raise ValueError("fp8: k_scales / v_scales / calibration_id only apply to scales='calibrated'")
        if self.scales == "calibrated" and not self.calibration_id:
            raise ValueError("fp8: scales='calibrated' needs a calibration_id naming the scale artifact")
        for name, vals in (("k_scales", self.k_scales), ("v_scales", self.v_scales)):
            if self.scale_axis == "tensor" and len(vals) > 1:
                raise ValueError(f"fp8: per-tensor {name} must hold one value, got {len(vals)}")
            if any(not np.isfinite(x) or x < np.finfo(np.float32).tiny for x in vals):
                raise ValueError(f"fp8: {name} must be finite, positive, normal float32 values, got {vals}")
        self._check_identity()

    @property
    def schema(self) -> CacheSchema:
        fmt = TensorFormat(payload=self.fmt, signed=True, zero="none", axis=self.scale_axis, group_size=0,
                           qparam_dtype="fp32", qparam_order="scale")
        cal = {"uncalibrated": "uncalibrated", "warmup": "warmup"}.get(self.scales, self.calibration_id)
        return CacheSchema(scheme="fp8", key=fmt, value=fmt, residual_dtype="none", calibration_id=cal,
                           extra=(("scale_source", self.scales),), **self._identity())

    def _initial(self, vals, num_kv_heads):
        if not vals:
            return jnp.ones((num_kv_heads,), jnp.float32)
        if len(vals) not in (1, num_kv_heads):
            raise ValueError(f"fp8: {len(vals)} calibrated scales for {num_kv_heads} KV heads")
        return jnp.broadcast_to(jnp.asarray(vals, jnp.float32), (num_kv_heads,))

    def init_layer(self, batch, capacity, num_kv_heads, head_dim):
        z = jnp.zeros((batch, num_kv_heads, capacity, head_dim), fp8_dtype(self.fmt))
        return FP8LayerState(k=z, v=z, k_scale=self._initial(self.k_scales, num_kv_heads),
                             v_scale=self._initial(self.v_scales, num_kv_heads))

    def _warmup(self, x, mask, old, warm):
        """Scale observed on the valid new rows ``x [B, H, T, D]`` unless the cache is already warm."""
        mag = jnp.where(mask[:, None, :, None], jnp.abs(x.astype(jnp.float32)), jnp.float32(0))
        amax = shard_max(jnp.max(mag, axis=(0, 2, 3)), BATCH)                         # [H], every sequence
        if self.scale_axis == "tensor":                                                 # every head of every shard
            amax = jnp.broadcast_to(shard_max(jnp.max(amax), HEADS), amax.shape)
        return jnp.where(warm, old, fp8_scale_from_absmax(amax, self.fmt, "warmup").value)

    def append_layer(self, state, lengths, k, v, num_new):
        return self._append(state, lengths, k, v, num_new, jnp.zeros_like(lengths))

    def supports_window_append(self) -> bool:
        return True

    def append_window_with_status(self, state, lengths, k, v, num_new, row0):
        """Window append: the warm-up test reads the TRUE lengths, rows land at ``position - row0``."""
        return self._append(state, lengths, k, v, num_new, row0), rows_finite(k, v, num_new)

    def observe_shared(self, state, lengths, k, v, num_new):
        """``scales="warmup"``: the scales observed on the valid rows of ``k, v [B, T, Hkv, D]`` unless the layer is
        warm (it holds a row at the layer's committed ``lengths``, over every batch shard); other sources: as is."""
        if self.scales != "warmup":
            return state
        mask = _rows.new_row_mask(num_new, k.shape[1])
        warm = shard_any(jnp.any(lengths > 0), BATCH)
        return state.replace(k_scale=self._warmup(_rows.head_major(k), mask, state.k_scale, warm),
                             v_scale=self._warmup(_rows.head_major(v), mask, state.v_scale, warm))

    def append_observed_with_status(self, state, lengths, k, v, num_new):
        """Rows encoded with the scales of ``state`` at body rows ``lengths + t`` (the scales are not touched)."""
        return self._encode(state, lengths, k, v, num_new), rows_finite(k, v, num_new)

    def _append(self, state, lengths, k, v, num_new, row0):
        return self._encode(self.observe_shared(state, lengths, k, v, num_new), lengths - row0, k, v, num_new)

    def _encode(self, state, first_row, k, v, num_new):
        """Valid rows ``t < num_new[b]`` of ``k, v [B, T, Hkv, D]`` written at rows ``first_row[b] + t`` under
        the scales of ``state``."""
        t = k.shape[1]
        mask = _rows.new_row_mask(num_new, t)
        kt, vt = _rows.head_major(k), _rows.head_major(v)
        pos = first_row[:, None] + _rows.arange_rows(t)[None, :]                # row index of each position
        kc = quantize_fp8(kt, state.k_scale, self.fmt, head_axis=1)
        vc = quantize_fp8(vt, state.v_scale, self.fmt, head_axis=1)
        return state.replace(k=_rows.write_rows(state.k, kc, pos, mask), v=_rows.write_rows(state.v, vc, pos, mask))

    def append_layer_with_status(self, state, lengths, k, v, num_new):
        return self.append_layer(state, lengths, k, v, num_new), rows_finite(k, v, num_new)

    def saturated_layer(self, state, k, v, num_new):
        """int32 ``[B, 2]``: per sequence, the valid new K and V elements whose ``|x / scale|`` exceeds the format's
        largest finite value (the saturating cast stores them as +-max), under the scales of ``state`` (the state
        after the append).  Read by :mod:`kvquant_jax.cache.status` and the kv_error metric."""
        mask = _rows.new_row_mask(num_new, k.shape[1])[:, None, :, None]
        hi = jnp.float32(fp8_max(self.fmt))
        out = []
        for x, sc in ((k, state.k_scale), (v, state.v_scale)):
            r = jnp.abs(_rows.head_major(x).astype(jnp.float32)) / sc[None, :, None, None]
            out.append(jnp.sum(mask & (r > hi), axis=(1, 2, 3), dtype=jnp.int32))
        return jnp.stack(out, axis=-1)

    def field_axes(self, state):
        """Codes ``[B, Hkv, C, D]``; scales ``[Hkv]``: per KV head (sharded with the heads) or one per-tensor value
        broadcast to every head (replicated: the warm-up max is taken over all heads and sequences of every shard)."""
        scale = (HEADS,) if self.scale_axis == "head" else (HEADS_REPLICATED,)
        return {"k": (BATCH, HEADS, None, None), "v": (BATCH, HEADS, None, None), "k_scale": scale, "v_scale": scale}

    def _stored_codes(self, state):
        """The layer's K and V codes as FP8 ``[B, Hkv, C, D]`` arrays (the storage hook the views below read; the
        transposed-V subclass stores bytes with V token-minor)."""
        return state.k, state.v

    def materialize_layer(self, state, lengths):
        kc, vc = self._stored_codes(state)
        valid = _rows.valid_rows(lengths, kc.shape[2])
        m = valid[:, None, :, None]
        k = jnp.where(m, dequantize_fp8(kc, state.k_scale, head_axis=1), jnp.float32(0))
        v = jnp.where(m, dequantize_fp8(vc, state.v_scale, head_axis=1), jnp.float32(0))
        return k, v, valid

    def validate_layer(self, state, lengths):
        kc, vc = self._stored_codes(state)
        for name, codes, scale in (("K", kc, state.k_scale), ("V", vc, state.v_scale)):
            checks.static_scales(f"{self.family} {name}", scale, per_tensor=self.scale_axis == "tensor",
                                 uncalibrated=self.scales == "uncalibrated")
            checks.finite_rows(f"{self.family} {name} codes", codes, lengths)

    def layer_nbytes(self, state):
        return {"codes": _rows.nbytes(state.k, state.v), "qparams": _rows.nbytes(state.k_scale, state.v_scale)}

    def decode_regions(self, state, lengths):
        """One region: float8 rows with the per-head scales ``[Hkv]``."""
        f = KVFormat(self.fmt, "head")
        return [region(KVOperand(state.k, state.k_scale, None, f), KVOperand(state.v, state.v_scale, None, f),
                       lengths)], 0

    def ledger_layer(self, batch, heads, head_dim, rows, *, logical, capacity):
        out = {}
        for t in "kv":
            out[("codes", t)] = batch * heads * rows * head_dim
            out[("qparams", t)] = heads * 4                               # float32 [Hkv] per tensor, unbatched
        return out


def load_scales(cache: KVCache, k_scales, v_scales) -> KVCache:
    """Set per-layer calibrated scales of every FP8 layer of ``cache`` (before any row is appended).

    ``k_scales, v_scales``: arrays ``[L]`` (per tensor) or ``[L, Hkv]`` indexed by GLOBAL layer; entries of
    layers that are not FP8 (skipped / full-precision layers of a mixed policy) are ignored.  Raises if a layer's
    scheme is not ``scales="calibrated"`` or the cache already holds rows (that would reinterpret history).
    """
    if np.asarray(jax.device_get(cache.lengths)).any():
        raise ValueError("fp8.load_scales: the cache already holds rows; scales must be set before the first "
                         "append (changing them would reinterpret stored codes)")
    groups = list(cache.groups)
    for g, (scheme, first, n) in enumerate(cache.schemes):
        if not isinstance(scheme, FP8Scheme):
            continue
        if scheme.scales != "calibrated":
            raise ValueError(f"fp8.load_scales: layers {first}..{first + n - 1} use scales={scheme.scales!r}, "
                             "not 'calibrated'")
        h = groups[g].k_scale.shape[-1]
        tensor = scheme.scale_axis == "tensor"
        groups[g] = groups[g].replace(
            k_scale=layer_scale_table(k_scales, first, n, h, tensor, "fp8.load_scales: k_scales"),
            v_scale=layer_scale_table(v_scales, first, n, h, tensor, "fp8.load_scales: v_scales"))
    return cache.replace(groups=tuple(groups))
