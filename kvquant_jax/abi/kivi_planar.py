"""The token-planar KIVI byte layout: KIVI codes stored the way the Mosaic GPU KIVI kernel reads them.

KIVI's quantizer (K per channel over ``G``-token groups, V per token over ``Gv``-channel groups, unsigned ``b``-bit
codes ``u`` with a min and a scale, ``x = u * scale + min``) is unchanged; only the bytes are arranged for
``pallas_kernels.decode_attention_mgpu_kivi`` (swap-AB wgmma: KV tokens are the M dimension, so the codes of one
byte must be ``P = 8 / b`` *different tokens*, and a masked byte tile must be a whole wgmma M tile of tokens).

Token-planar packing in blocks of ``BT = plane_rows * P`` tokens (``plane_rows`` = 64 for the kernel: one wgmma M
tile; the layout itself takes any ``plane_rows >= 1``, which the CPU tests use to keep shapes small).  Row ``t``
(a position, or ``position - row0`` in a paged window whose first row is a page boundary) lives at::

    block = t // BT,  plane r = (t % BT) // plane_rows,  byte row = block * plane_rows + t % plane_rows

at bits ``[b*r, b*(r+1))`` of that byte.  The top plane (``r = P - 1``) stores ``u XOR 2^(b-1)``: read as a signed
byte after masking it is ``(u - 2^(b-1)) << b*r``, exact under the kernel's signed int8 -> bf16 conversion (Mosaic
GPU has no 8-bit shifts; the kernel masks, it does not shift).  One layer (``[B, Hkv, ...]`` head-major, ``C`` a
multiple of ``BT``)::

    k_codes  uint8 [B, Hkv, C / P, D]   K codes, byte rows as above (the kernel's K operand, [tokens, channels])
    v_codes  uint8 [B, Hkv, D, C / P]   V codes transposed: for each channel the tokens' bytes (the PV product's
                                        A operand is V^T, whose register fragment needs tokens contiguous)
    k_scale, k_min  [B, Hkv, C / G, D]  per K group and channel (as the layout-1 KIVI cache)
    v_scale, v_min  [B, Hkv, D / Gv, C] per V channel group and token: transposed (tokens contiguous, one TMA tile
                                        per block)

An empty slot holds byte 0 (decodes to some code: every reader masks rows past the frontier) and scale 1 / min 0.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

__all__ = ["LAYOUT_TAG", "PlaneBlocks", "KiviPlanarFormat", "KiviPlanarOperand", "planar_index", "pack_token_planar",
           "unpack_token_planar", "write_planar", "take_planar"]

#: the physical-layout tag every schema of this layout records (``CacheSchema.extra``)
LAYOUT_TAG = "kivi_token_planar_k+v_token_minor"


class PlaneBlocks:
    """Block geometry of a token-planar layout (fields ``bits`` and ``plane_rows``): ``planes = 8 / bits`` tokens
    per byte, ``block_t`` tokens per block; :meth:`_check_planes` refuses widths and plane sizes the layout has no
    meaning for.  Shared by :class:`KiviPlanarFormat` and ``abi.token_planar.TokenPlanarFormat``."""

    def _check_planes(self, what: str) -> None:
        if self.bits not in (2, 4):
            raise ValueError(f"{what}: bits must be 2 or 4, got {self.bits!r}")
        if self.plane_rows < 1:
            raise ValueError(f"{what}: plane_rows must be >= 1, got {self.plane_rows!r}")

    @property
    def planes(self) -> int:
        return 8 // self.bits

    @property
    def block_t(self) -> int:
        return self.plane_rows * self.planes

    def capacity_unsupported(self, capacity: int) -> str | None:
        """Why a layer of ``capacity`` rows (or a page of that many) cannot hold this layout (None when it can): a
        byte holds tokens of one block, so the capacity must be whole blocks."""
        if capacity % self.block_t:
            return (f"capacity {capacity} must be a multiple of the {self.block_t}-token block ({self.plane_rows} "
                    f"rows x {self.planes} planes of {self.bits}-bit codes per byte; a paged cache's page_size too: "
                    "a byte holds tokens of one block)")
        return None


@dataclasses.dataclass(frozen=True)
class KiviPlanarFormat(PlaneBlocks):
    """Static description of one layer in the token-planar KIVI layout (hashable: a jit static / dispatch key).

    Attributes:
      bits: code width of K and V (2 or 4).
      group: G, tokens per K scale row.
      v_group: Gv, channels per V qparam (0 = the whole head vector).
      plane_rows: tokens per plane of a block (64 for the Mosaic GPU kernel).
      qparam_dtype: scale / min storage ("fp16", "bf16" or "fp32").
    """

    bits: int
    group: int
    v_group: int
    plane_rows: int = 64
    qparam_dtype: str = "fp16"

    def __post_init__(self):
        self._check_planes("kivi planar layout")

    @property
    def payload(self) -> str:
        return f"kivi{self.bits}_planar"


@struct.dataclass
class KiviPlanarOperand:
    """One layer of a token-planar KIVI cache as a fused decode kernel reads it, at given committed lengths.

    The stored fields as in the module docstring (``[B, Hkv, ...]``, read in place), plus what the lengths decide
    (the cache scheme derives it from its frontiers):

    * ``end int32 [B]``: rows ``[0, end)`` are read from codes (the quantized region; ``min(K, V frontier)``);
    * ``tail_k, tail_v float32 [B, Hkv, Nt, D]``: positions ``[end, end + Nt)`` in full precision (residual ring
      rows, and rows whose K group has closed while their V row is still in the ring, decoded from codes),
      live where ``j < tail_len int32 [B]``.  Both parts join one softmax.
    """

    k_codes: jax.Array      # uint8 [B, Hkv, C/P, D]
    v_codes: jax.Array      # uint8 [B, Hkv, D, C/P]
    k_scale: jax.Array      # [B, Hkv, C/G, D]
    k_min: jax.Array        # [B, Hkv, C/G, D]
    v_scale: jax.Array      # [B, Hkv, D/Gv, C]
    v_min: jax.Array        # [B, Hkv, D/Gv, C]
    end: jax.Array          # int32 [B]
    tail_k: jax.Array       # float32 [B, Hkv, Nt, D]
    tail_v: jax.Array       # float32 [B, Hkv, Nt, D]
    tail_len: jax.Array     # int32 [B]


def planar_index(t, bits: int, plane_rows: int):
    """``(byte_row, plane)`` of rows ``t`` (int array): see the module docstring."""
    p = 8 // bits
    bt = plane_rows * p
    return (t // bt) * plane_rows + t % plane_rows, (t % bt) // plane_rows


def _top_mask(p: int, bits: int, xp, dtype=np.uint32):
    """``[P, 1, 1]``: ``2^(bits-1)`` on the top plane, 0 elsewhere (the re-centring XOR)."""
    return xp.asarray(((np.arange(p) == p - 1) * 2 ** (bits - 1)).astype(dtype).reshape(p, 1, 1))


def pack_token_planar(u, bits: int, plane_rows: int = 64, xp=jnp):
    """Unsigned codes ``[..., T, X]`` (values < 2^bits, ``T`` a multiple of ``BT``) -> token-planar bytes
    ``[..., T/P, X]`` uint8 (module docstring; ``xp`` = ``jnp`` or ``np``)."""
    p = 8 // bits
    *lead, t, x = u.shape
    if t % (plane_rows * p):
        raise ValueError(f"pack_token_planar: {t} rows is not a multiple of the block of {plane_rows * p} tokens")
    w = xp.asarray(u).astype(np.uint32).reshape(*lead, t // (plane_rows * p), p, plane_rows, x)
    shifts = xp.asarray((np.arange(p, dtype=np.uint32) * bits).reshape(p, 1, 1))
    byte = ((w ^ _top_mask(p, bits, xp)) << shifts).sum(axis=-3)
    return byte.astype(np.uint8).reshape(*lead, t // p, x)


def unpack_token_planar(packed, bits: int, plane_rows: int = 64, xp=np):
    """Inverse of :func:`pack_token_planar`: ``[..., T/P, X]`` (uint8 or int8) -> ``[..., T, X]`` int32 codes."""
    p = 8 // bits
    b = xp.asarray(packed).astype(np.int32) & 0xFF
    *lead, tp, x = b.shape
    b = b.reshape(*lead, tp // plane_rows, 1, plane_rows, x)
    shifts = xp.asarray((np.arange(p, dtype=np.int32) * bits).reshape(p, 1, 1))
    u = ((b >> shifts) & (2 ** bits - 1)) ^ _top_mask(p, bits, xp, np.int32)
    return u.reshape(*lead, tp * p, x)


def write_planar(buf: jax.Array, u: jax.Array, rows: jax.Array, keep: jax.Array, bits: int, plane_rows: int,
                 token_axis: int) -> jax.Array:
    """Write unsigned codes of rows ``rows [B, W]`` (where ``keep [B, W]``) into a token-planar buffer; every
    other code keeps its value.

    ``token_axis=2``: ``buf [B, H, NR, X]`` (K: byte rows), ``u [B, H, W, X]``.  ``token_axis=3``: ``buf [B, H, X,
    NR]`` (V^T), ``u [B, H, W, X]`` (token-major, transposed here).  One pass per plane: the rows of one plane map
    to distinct bytes, and each pass clears its plane's bits and then adds the code into them (two in-place
    scatters that read only their own operand), so the other planes' tokens, possibly committed rows, are kept."""
    p = 8 // bits
    b, h = buf.shape[:2]
    n = buf.shape[token_axis]
    byte_row, plane = planar_index(rows, bits, plane_rows)
    mask = (1 << bits) - 1
    top = 1 << (bits - 1)
    uu = u.astype(jnp.uint8)
    bi = jnp.arange(b, dtype=jnp.int32)[:, None, None, None]
    hi = jnp.arange(h, dtype=jnp.int32)[None, :, None, None]
    if token_axis == 3:
        uu = jnp.swapaxes(uu, 2, 3)                                                    # [B, H, X, W]
        xi = jnp.arange(buf.shape[2], dtype=jnp.int32)[None, None, :, None]
    for r in range(p):
        sel = keep & (plane == r)
        col = jnp.where(sel, byte_row, jnp.int32(n))                                  # [B, W]; n = dropped
        val = jnp.left_shift(jnp.bitwise_xor(uu, np.uint8(top)) if r == p - 1 else uu, np.uint8(bits * r))
        clear = np.uint8(~(mask << (bits * r)) & 0xFF)
        if token_axis == 2:
            idx = (bi[..., 0], hi[..., 0], col[:, None, :])
        else:
            idx = (bi, hi, xi, col[:, None, None, :])
        buf = buf.at[idx].apply(lambda x, c=clear: jnp.bitwise_and(x, c), mode="drop")
        buf = buf.at[idx].add(val, mode="drop")
    return buf


def take_planar(buf: jax.Array, rows: jax.Array, bits: int, plane_rows: int) -> jax.Array:
    """Unsigned codes of rows ``rows [B, W]`` (in range) from a K-style buffer ``buf [B, H, NR, X]`` ->
    ``[B, H, W, X]`` int32."""
    b, h = buf.shape[:2]
    byte_row, plane = planar_index(rows, bits, plane_rows)
    bi = jnp.arange(b, dtype=jnp.int32)[:, None, None]
    hi = jnp.arange(h, dtype=jnp.int32)[None, :, None]
    byte = buf[bi, hi, byte_row[:, None, :]].astype(jnp.int32)                         # [B, H, W, X]
    shift = (plane * bits)[:, None, :, None]
    top = jnp.where(plane == 8 // bits - 1, 1 << (bits - 1), 0)[:, None, :, None]
    return jnp.bitwise_xor(jnp.right_shift(byte, shift) & ((1 << bits) - 1), top)
