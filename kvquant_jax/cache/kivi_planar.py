"""KIVI in the token-planar layout the Mosaic GPU KIVI kernel reads in place (registry ``kivi2_planar``, ``kivi4_planar``).

The same quantizer, frontiers, residual rings, truncation and byte ledger as :class:`kvquant_jax.cache.kivi.
KIVIScheme` (every closed row gets the same codes and qparams); only the bytes are arranged differently
(:mod:`kvquant_jax.abi.kivi_planar`): codes packed along *tokens*, planar in blocks of ``BT = plane_rows * 8/b``
tokens, V codes and V qparams transposed (tokens contiguous).

Why a separate layout: the layout-1 KIVI cache packs codes along head_dim, which the Pallas Triton kernel reads at
0.16x cuDNN (H200); the Mosaic GPU kernel (``pallas_kernels.decode_attention_mgpu_kivi``, 2.5-3.9x the Triton
kernel, one run) wants token-planar codes, and converting every step would read and write every code again.  This
cache pays at append time instead: a closing K group writes one plane of G byte rows, a closing V row one plane of
a strided column per channel (read-modify-write of one plane's bits: the other planes' rows, possibly committed,
keep their value), and a strided column of the transposed V qparams.

Decode: :meth:`fused_decode_operand` hands the layer (plus its frontiers' small dense tail, built by the same code
as the layout-1 scheme's) to ``attention.dispatch``, which routes it by format type to the Mosaic GPU kernel on a
GPU with Mosaic GPU (sm_90) where the kernel takes the shape; anywhere else the layer is read through its exact
materialize view.

Shapes: the capacity (and a paged cache's page size) must be a multiple of ``BT`` (256 tokens for 2-bit, 128 for
4-bit with the kernel's ``plane_rows = 64``); K and V share the bit width (2 or 4).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvquant_jax.abi import kivi_planar as kp
from kvquant_jax.cache import _rows
from kvquant_jax.cache.interface import CacheScheme
from kvquant_jax.cache.kivi import KIVIScheme
from kvquant_jax.cache.schema import CacheSchema


@dataclasses.dataclass(frozen=True)
class KIVIPlanarScheme(KIVIScheme):
    """KIVI with token-planar codes (module doc).  Fields as :class:`KIVIScheme` plus:

    Attributes:
      plane_rows: tokens per plane of a block (64 for the Mosaic GPU kernel; smaller values are for tests).
    """

    family = "kivi_planar"
    presets = {"kivi2_planar": {"k_bits": 2, "v_bits": 2}, "kivi4_planar": {"k_bits": 4, "v_bits": 4}}

    plane_rows: int = 64
    kernel_family: str = "mosaic_gpu_kivi"

    def __post_init__(self):
        super().__post_init__()
        if self.k_bits != self.v_bits or self.k_bits not in (2, 4):
            raise ValueError(f"kivi_planar: k_bits and v_bits must be equal and 2 or 4, got {self.k_bits} / "
                             f"{self.v_bits} (the layout packs K and V in the same token blocks)")
        if self.plane_rows < 1:
            raise ValueError(f"kivi_planar: plane_rows must be >= 1, got {self.plane_rows}")

    @property
    def block_t(self) -> int:
        return self.kernel_format.block_t

    @property
    def kernel_format(self) -> kp.KiviPlanarFormat:
        return kp.KiviPlanarFormat(bits=self.k_bits, group=self.group_size, v_group=self.v_group_size,
                                   plane_rows=self.plane_rows, qparam_dtype=self.qparam_dtype)

    @property
    def schema(self) -> CacheSchema:
        base = super().schema
        extra = (("physical_layout", kp.LAYOUT_TAG), ("plane_rows", str(self.plane_rows)))
        return dataclasses.replace(base, scheme=self.family, extra=tuple(sorted(base.extra + extra)))

    # ----- state -----
    def _check_capacity(self, capacity: int) -> None:
        why = self.kernel_format.capacity_unsupported(capacity)
        if why:
            raise ValueError(f"kivi_planar: {why}")

    def _stored_shapes(self, capacity, head_dim, v_groups):
        """Codes ``[C*b/8, D]`` (K) and ``[D, C*b/8]`` (V^T), V qparams ``[D/Gv, C]``; C a multiple of the block."""
        self._check_capacity(capacity)
        nr = capacity * self.k_bits // 8
        return (nr, head_dim), (head_dim, nr), (v_groups, capacity)

    def _capacity(self, state) -> int:
        return state.v_scale.shape[-1]

    def _write_closed(self, codes, scale, mn, u, q_scale, q_min, rows, row_keep, gidx, keep, bits, per_channel):
        codes = kp.write_planar(codes, u, rows, row_keep, bits, self.plane_rows, token_axis=2 if per_channel else 3)
        if per_channel:
            return codes, _rows.write_rows(scale, q_scale, gidx, keep), _rows.write_rows(mn, q_min, gidx, keep)
        return codes, _write_columns(scale, q_scale, gidx, keep), _write_columns(mn, q_min, gidx, keep)

    def _unpacked(self, state, head_dim):
        del head_dim
        k_u = kp.unpack_token_planar(state.k_codes, self.k_bits, self.plane_rows, xp=jnp)
        v_u = kp.unpack_token_planar(jnp.swapaxes(state.v_codes, 2, 3), self.v_bits, self.plane_rows, xp=jnp)
        return (k_u, v_u) + self._v_qparams(state)

    def _v_qparams(self, state):
        """``(v_scale, v_min)`` row-major ``[B, H, C, D/Gv]`` (stored transposed)."""
        return jnp.swapaxes(state.v_scale, 2, 3), jnp.swapaxes(state.v_min, 2, 3)

    def _decoded_rows(self, state, row, grp):
        st = state
        f32 = jnp.float32
        k = (kp.take_planar(st.k_codes, row, self.k_bits, self.plane_rows).astype(f32)
             * _rows.take_rows(st.k_scale, grp).astype(f32) + _rows.take_rows(st.k_min, grp).astype(f32))
        v_u = kp.take_planar(jnp.swapaxes(st.v_codes, 2, 3), row, self.v_bits, self.plane_rows).astype(f32)
        vs, vm = (jnp.repeat(_rows.take_rows(a, row).astype(f32), k.shape[-1] // a.shape[-1], axis=-1)
                  for a in self._v_qparams(st))
        return k, v_u * vs + vm

    # ----- decode attention -----
    def decode_regions(self, state, lengths):
        """The exact materialize view as one dense region (the reference and non-GPU path; the kernel path reads
        the layer through :meth:`fused_decode_operand`)."""
        return CacheScheme.decode_regions(self, state, lengths)

    def fused_decode_operand(self, state, lengths):
        """``(KiviPlanarFormat, KiviPlanarOperand)``: the stored layer read in place, plus the quantized region's
        end ``min(fk, fv)`` and the small dense tail past it (:meth:`KIVIScheme._tail`, the same rows the layout-1
        scheme's tail region holds), attended in the same softmax."""
        fk, fv = self.frontiers(lengths)
        lo = jnp.minimum(fk, fv).astype(jnp.int32)
        k_t, v_t, _ = self._tail(state, lo, fk, fv)
        return self.kernel_format, kp.KiviPlanarOperand(
            k_codes=state.k_codes, v_codes=state.v_codes, k_scale=state.k_scale, k_min=state.k_min,
            v_scale=state.v_scale, v_min=state.v_min, end=lo, tail_k=k_t, tail_v=v_t,
            tail_len=(lengths - lo).astype(jnp.int32))


def _write_columns(buf: jax.Array, vals: jax.Array, index: jax.Array, keep: jax.Array) -> jax.Array:
    """``buf[b, h, :, index[b, j]] = vals[b, h, j, :]`` where ``keep[b, j]`` (``buf [B, H, X, N]``, ``vals [B, H,
    W, X]``, ``index, keep [B, W]``); other columns unchanged (dropped ones point out of bounds)."""
    b, h, x, n = buf.shape
    col = jnp.where(keep, index, jnp.int32(n))[:, None, None, :]
    bi = jnp.arange(b, dtype=jnp.int32)[:, None, None, None]
    hi = jnp.arange(h, dtype=jnp.int32)[None, :, None, None]
    xi = jnp.arange(x, dtype=jnp.int32)[None, None, :, None]
    return buf.at[bi, hi, xi, col].set(jnp.swapaxes(vals, 2, 3).astype(buf.dtype), mode="drop")
