"""Evaluation-only cache scheme for the KIVI axis ablation (K per-channel vs per-token, V per-token vs per-channel).

``KIVIScheme`` fixes KIVI's axes (K per channel over G tokens, V per token).  The ablation needs the swapped axes,
so this module simulates them with the same quantizer (``kvquant_jax.quant.affine``, ``zero="min"``, qparams in
``qparam_dtype``, the same too-narrow-group sentinel) and the same closure rule ("kivi"):

* a **per-channel** tensor closes whole R-token chunks: quantized frontier ``(L // R) * R`` (``(L // G) * G`` when
  ``R = 0``) -- KIVI's K frontier;
* a **per-token** tensor rolls one row at a time: quantized frontier ``max(0, L - R)`` (``L`` when ``R = 0``) --
  KIVI's V frontier;
* rows at or above a tensor's frontier are full precision, rounded through ``residual_dtype``; as in the KIVI
  cache, the quantizer sees that rounded row.

It is a *simulation*: the state keeps the exact rows (float32) and quantizes the closed region when it is read.
Because a closed group depends only on its own rows (path independence, see ``cache/kivi.py``), this decodes to
the same values as quantizing at closure time -- exactly the KIVI cache's values on KIVI's axes (tested, fp16 and
fp32 residuals), and KIVI's with K and V exchanged on the swapped axes.  Stored bytes are therefore NOT the bytes of a
real packed cache: the byte metric uses :meth:`AxisAblationScheme.logical_bits` (the packed layout's codes +
scale/min qparams + residual rows) and marks the row ``simulated``.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from kvquant_jax.cache import _rows, checks
from kvquant_jax.cache.interface import SchemeBase
from kvquant_jax.cache.kivi import KIVIScheme, kivi_frontiers
from kvquant_jax.cache.schema import CacheSchema, TensorFormat
from kvquant_jax.quant.affine import dequantize_affine, quantize_affine_with_status
from kvquant_jax.quant.dtypes import DTYPE_BYTES, DTYPES
from kvquant_jax.quant.ledger import packed_bytes

AXES = ("channel", "token")


@struct.dataclass
class AblationLayerState:
    """Exact rows ``k, v: float32 [B, Hkv, C', D]`` (``C'`` = capacity rounded up to a multiple of G)."""

    k: jax.Array
    v: jax.Array


@dataclasses.dataclass(frozen=True)
class AxisAblationScheme(SchemeBase):
    """KIVI-style asymmetric quantization with free K and V axes (simulated; see module doc).

    Attributes:
      k_axis, v_axis: "channel" (groups of ``group_size`` tokens per channel) or "token" (groups of
        ``token_group_size`` head-dim elements per token; 0 = the whole head vector).
      k_bits, v_bits: code widths (1, 2, 4 or 8, as KIVI's packed layout).
      group_size: G; residual: R (multiple of G); qparam_dtype, residual_dtype: "fp16" / "bf16" / "fp32".
    """

    family = "axis_ablation"
    presets = {"kivi_axes": {}}
    aliases = {"bits": ("k_bits", "v_bits"), "residual_length": ("residual",)}

    k_axis: str = "channel"
    v_axis: str = "token"
    k_bits: int = 2
    v_bits: int = 2
    group_size: int = 32
    token_group_size: int = 32
    residual: int = 128
    qparam_dtype: str = "fp16"
    residual_dtype: str = "fp16"

    def __post_init__(self):
        checks.choice("axis_ablation", self, ("k_axis", "v_axis"), AXES)
        # every other field has KIVI's meaning and constraints (bits, G | R, dtypes, RoPE identity)
        KIVIScheme(k_bits=self.k_bits, v_bits=self.v_bits, group_size=self.group_size,
                   v_group_size=self.token_group_size, residual=self.residual, qparam_dtype=self.qparam_dtype,
                   residual_dtype=self.residual_dtype, **self._identity())

    def _format(self, axis: str, bits: int) -> TensorFormat:
        return TensorFormat(payload=f"uint{bits}", signed=False, zero="min", axis=axis,
                            group_size=self.group_size if axis == "channel" else self.token_group_size,
                            qparam_dtype=self.qparam_dtype, qparam_order="scale,min")

    @property
    def schema(self) -> CacheSchema:
        return CacheSchema(scheme="axis_ablation", key=self._format(self.k_axis, self.k_bits),
                           value=self._format(self.v_axis, self.v_bits), residual=self.residual,
                           residual_rule="kivi", residual_dtype=self.residual_dtype,
                           extra=(("simulated", "true"),), **self._identity())

    def _token_group(self, head_dim: int) -> int:
        g = self.token_group_size or head_dim
        if head_dim % g:
            raise ValueError(f"axis_ablation: head_dim {head_dim} is not a multiple of token_group_size {g}")
        return g

    def frontier(self, axis: str, lengths):
        chunk, rolling = kivi_frontiers(lengths, "kivi", self.residual, self.group_size)
        return chunk if axis == "channel" else rolling

    def init_layer(self, batch, capacity, num_kv_heads, head_dim):
        self._token_group(head_dim)
        c = -(-capacity // self.group_size) * self.group_size
        z = jnp.zeros((batch, num_kv_heads, c, head_dim), jnp.float32)
        return AblationLayerState(k=z, v=z)

    def append_layer(self, state, lengths, k, v, num_new):
        t = k.shape[1]
        pos = lengths[:, None] + _rows.arange_rows(t)[None, :]
        mask = _rows.new_row_mask(num_new, t)
        return AblationLayerState(k=_rows.write_rows(state.k, _rows.head_major(k), pos, mask),
                                  v=_rows.write_rows(state.v, _rows.head_major(v), pos, mask))

    def _decode(self, x, axis: str, bits: int, frontier, valid):
        if axis == "channel":
            ax, g = 2, self.group_size
        else:
            ax, g = 3, self._token_group(x.shape[-1])
        res = x.astype(DTYPES[self.residual_dtype]).astype(jnp.float32)   # every row is first a residual row
        q, status = quantize_affine_with_status(res, bits, axis=ax, group_size=g,
                                                qparam_dtype=DTYPES[self.qparam_dtype], zero="min")
        narrow, _ = _rows.split_status(status)
        deq = dequantize_affine(q.codes, _rows.sentinel_scale(q.scale, narrow), q.zero_or_min, axis=ax,
                                group_size=g, zero="min")
        out = jnp.where(_rows.rows_below(frontier, x.shape[2]), deq, res)
        return jnp.where(valid[:, None, :, None], out, jnp.float32(0))

    def materialize_layer(self, state, lengths):
        c = state.k.shape[2]
        valid = _rows.valid_rows(lengths, c)
        k = self._decode(state.k, self.k_axis, self.k_bits, self.frontier(self.k_axis, lengths), valid)
        v = self._decode(state.v, self.v_axis, self.v_bits, self.frontier(self.v_axis, lengths), valid)
        return k, v, valid

    def layer_nbytes(self, state):
        return {"residual": _rows.nbytes(state.k, state.v)}

    def ledger_layer(self, batch, heads, head_dim, rows, *, logical, capacity):
        """Physical: the simulation's float32 rows (capacity rounded up to G).  Logical: the packed layout it
        simulates (codes + (scale, min) qparams of closed rows / groups + residual rows, as
        :meth:`logical_bits`)."""
        b, h, d = batch, heads, head_dim
        if not logical:
            n = b * h * (-(-capacity // self.group_size) * self.group_size) * d * 4
            return {("residual", "k"): n, ("residual", "v"): n}
        qb, rb = DTYPE_BYTES[self.qparam_dtype], DTYPE_BYTES[self.residual_dtype]
        out = {}
        for t, axis, bits in (("k", self.k_axis, self.k_bits), ("v", self.v_axis, self.v_bits)):
            f = int(self.frontier(axis, rows))
            groups = (f // self.group_size) * d if axis == "channel" else f * (d // self._token_group(d))
            out[("codes", t)] = b * h * f * packed_bytes(d, bits)
            out[("qparams", t)] = b * h * groups * 2 * qb
            out[("residual", t)] = b * h * (rows - f) * d * rb
        return out

    def logical_bits(self, length: int, head_dim: int) -> dict:
        """Bits per cached element of the equivalent packed layout at ``length`` rows (per head, averaged over K
        and V): codes + (scale, min) qparams of closed groups + residual rows."""
        qb = 8 * jnp.dtype(DTYPES[self.qparam_dtype]).itemsize
        rb = 8 * jnp.dtype(DTYPES[self.residual_dtype]).itemsize
        total = {"codes": 0.0, "qparams": 0.0, "residual": 0.0}
        for axis, bits in ((self.k_axis, self.k_bits), (self.v_axis, self.v_bits)):
            f = int(self.frontier(axis, jnp.asarray([length], jnp.int32))[0])
            total["codes"] += f * head_dim * bits
            if axis == "channel":
                total["qparams"] += (f // self.group_size) * head_dim * 2 * qb
            else:
                total["qparams"] += f * (head_dim // self._token_group(head_dim)) * 2 * qb
            total["residual"] += (length - f) * head_dim * rb
        elems = 2 * length * head_dim
        return {k: v / elems for k, v in total.items()}
