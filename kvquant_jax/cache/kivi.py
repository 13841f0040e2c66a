"""KIVI: keys per channel over groups of G tokens, values per token, a full-precision recent residual (0x06).

Quantizer (``kvquant_jax.quant.affine``, ``zero="min"``): ``scale = (max - min) / (2^b - 1)`` and ``min`` stored in
the qparam dtype, ``u = clip(rint((x - min) / scale), 0, 2^b - 1)``, ``x_hat = u * scale + min``.  ``x`` is the row
rounded to the residual dtype: every row is full precision (in ``residual_dtype``) before it closes, and the
quantizer sees that stored value whether the row closes in the append that brought it or later from the ring.
K groups are ``G`` consecutive tokens of one channel of one head; V groups are ``G_d`` consecutive head-dim
elements of one token of one head (``G_d = v_group_size``, 0 = the whole head vector).  Constant and too-narrow
groups store the sentinel scale 1 with zero codes and decode to their stored min (``_rows.split_status``).

Frontiers (pure functions of the committed length ``L``; nothing else is stored):

``residual_rule="kivi"`` (the official implementation's closure):
    K quantized frontier ``(L // R) * R``: K closes a whole R-token residual chunk (R/G groups) when it fills.
    V quantized frontier ``max(0, L - R)``: V rows leave a rolling R-row tail one at a time.
    So K's and V's quantized frontiers differ (K keeps ``L mod R`` fp rows, V keeps ``min(L, R)``).
``residual_rule="synchronized"`` (the design notes' teaching variant, 0x06B / 0x04B):
    K and V share ``q(L) = min(G * floor(L / G), G * ceil(max(0, L - R) / G))``: whenever more than R rows are
    full precision, the oldest whole G-row groups close, so the tail holds ``(R - G, R]`` rows once ``L > R``.
``R = 0`` (allowed for both rules): there is no recent window, but a K group can only close when its G rows exist,
    so K's frontier is ``G * floor(L / G)`` and the incomplete K group stays full precision (in a G-slot ring).
    V is quantized immediately under "kivi" (per-token qparams need no other rows) and with K's groups under
    "synchronized".
``R`` must be a multiple of ``G``.  Everything is independent of the path: appending rows one at a time or all at
once gives the same codes (a closed group depends only on its own rows), which is what makes prefill, decode and
truncate-then-append agree.

Residual rings (layout: ``k_res [B, Hkv, S_k, D]``, ``v_res [B, Hkv, S_v, D]``, slot = position mod S):
    "kivi":         ``S_k = R`` (live span ``L mod R < R``), ``S_v = R + 1`` (live span ``<= R``, plus the slot a
                    one-row append writes).  ``R = 0``: ``S_k = G``, ``S_v = 0``.
    "synchronized": ``S_k = S_v = R + 1`` (``G`` when ``R = 0``).
A one-row append writes the ring slot of position ``L`` (never live at ``L``), the code rows / groups past the old
frontier, and nothing else; a multi-row append may reuse live ring slots (``ring_fields``: ``ops.publish`` keeps
the old rings when such an append is rejected).

Quantized layout: ``k_codes, v_codes: uint8 [B, Hkv, C, D*b/8]`` (packed along head_dim); ``k_scale, k_min:
[B, Hkv, C // G, D]``; ``v_scale, v_min: [B, Hkv, C, D // G_d]`` (qparam dtype).  Row ``i`` of the code arrays is
position ``i``; K group ``j`` covers positions ``[j G, (j + 1) G)``.

Truncation: a closed K group or a V row that left the tail cannot be reopened exactly from its codes.  A truncation
whose shorter length needs such rows in full precision again reports them through :meth:`KIVIScheme.rebuild_start`
and ``ops.truncate`` requires the original rows (or raises) -- see ``kvquant_jax/cache/ops.py``.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvquant_jax.abi.reference import dequantize_operand
from kvquant_jax.abi.regions import KVFormat, KVOperand, Region, dense_operand, region
from kvquant_jax.cache import _rows, checks
from kvquant_jax.cache.interface import SchemeBase, rows_finite
from kvquant_jax.cache.schema import CacheSchema, TensorFormat
from kvquant_jax.quant.affine import dequantize_affine, quantize_affine_with_status
from kvquant_jax.quant.dtypes import DTYPE_BYTES, DTYPES
from kvquant_jax.quant.ledger import packed_bytes
from kvquant_jax.quant.packing import pack_bits, unpack_bits

RULES = ("kivi", "synchronized")


@struct.dataclass
class KIVILayerState:
    k_codes: jax.Array
    k_scale: jax.Array
    k_min: jax.Array
    v_codes: jax.Array
    v_scale: jax.Array
    v_min: jax.Array
    k_res: jax.Array
    v_res: jax.Array


def kivi_ring_sizes(rule: str, residual: int, group: int) -> tuple[int, int]:
    """``(S_k, S_v)`` ring slots for a closure rule."""
    if rule == "kivi":
        return (residual, residual + 1) if residual else (group, 0)
    return (residual + 1, residual + 1) if residual else (group, group)


def kivi_frontiers(lengths, rule: str, residual: int, group: int):
    """``(k_frontier, v_frontier)`` for int arrays (NumPy or JAX) of committed lengths."""
    xp = jnp if isinstance(lengths, jax.Array) else np
    whole = (lengths // group) * group
    if rule == "kivi":
        if residual:
            return (lengths // residual) * residual, xp.maximum(lengths - residual, 0)
        return whole, lengths
    closed = ((xp.maximum(lengths - residual, 0) + group - 1) // group) * group
    q = xp.minimum(whole, closed)
    return q, q


@dataclasses.dataclass(frozen=True)
class KIVIScheme(SchemeBase):
    """KIVI K-per-channel / V-per-token cache with a full-precision residual.

    Attributes:
      k_bits, v_bits: code widths (1, 2, 4 or 8; the paper uses 2 or 4).
      group_size: G, tokens per K channel group (and the closure granularity).
      v_group_size: G_d, head-dim elements per V qparam group (0: the whole head vector).
      residual: R, recent full-precision rows (multiple of G; 0 allowed, see module doc).
      residual_rule: "kivi" (official closure) or "synchronized".
      qparam_dtype: scale/min storage ("fp16" default, "bf16", "fp32").
      residual_dtype: residual ring storage ("fp16" default as in the paper's fp16 models, "bf16", "fp32").
    """

    family = "kivi"
    presets = {"kivi2": {"k_bits": 2, "v_bits": 2}, "kivi4": {"k_bits": 4, "v_bits": 4}}
    aliases = {"bits": ("k_bits", "v_bits"), "rule": ("residual_rule",), "k_group_size": ("group_size",),
               "residual_length": ("residual",)}
    ring_fields = ("k_res", "v_res")

    k_bits: int = 2
    v_bits: int = 2
    group_size: int = 32
    v_group_size: int = 32
    residual: int = 128
    residual_rule: str = "kivi"
    qparam_dtype: str = "fp16"
    residual_dtype: str = "fp16"

    def __post_init__(self):
        checks.choice("kivi", self, ("k_bits", "v_bits"), (1, 2, 4, 8), listing="1, 2, 4 or 8")
        if self.group_size < 1:
            raise ValueError(f"kivi: group_size must be >= 1, got {self.group_size}")
        if self.v_group_size < 0:
            raise ValueError(f"kivi: v_group_size must be >= 0, got {self.v_group_size}")
        if self.residual < 0 or self.residual % self.group_size:
            raise ValueError(f"kivi: residual ({self.residual}) must be a non-negative multiple of group_size "
                             f"({self.group_size})")
        checks.choice("kivi", self, "residual_rule", RULES)
        checks.choice("kivi", self, ("qparam_dtype", "residual_dtype"), sorted(DTYPES))
        self._check_identity()

    # ----- static description -----
    @property
    def schema(self) -> CacheSchema:
        key = TensorFormat(payload=f"uint{self.k_bits}", signed=False, zero="min", axis="channel",
                           group_size=self.group_size, qparam_dtype=self.qparam_dtype, qparam_order="scale,min")
        value = TensorFormat(payload=f"uint{self.v_bits}", signed=False, zero="min", axis="token",
                             group_size=self.v_group_size, qparam_dtype=self.qparam_dtype, qparam_order="scale,min")
        return CacheSchema(scheme="kivi", key=key, value=value, residual=self.residual,
                           residual_rule=self.residual_rule, residual_dtype=self.residual_dtype, **self._identity())

    @property
    def ring_sizes(self) -> tuple[int, int]:
        return kivi_ring_sizes(self.residual_rule, self.residual, self.group_size)

    def frontiers(self, lengths):
        """``(k_frontier, v_frontier)``: rows below are quantized; ``[frontier, length)`` is full precision."""
        return kivi_frontiers(lengths, self.residual_rule, self.residual, self.group_size)

    def _v_group(self, head_dim: int) -> int:
        g = self.v_group_size or head_dim
        if head_dim % g:
            raise ValueError(f"kivi: head_dim {head_dim} is not a multiple of v_group_size {g}")
        for bits in (self.k_bits, self.v_bits):
            if (head_dim * bits) % 8:
                raise ValueError(f"kivi: head_dim {head_dim} * {bits} bits does not fill whole bytes")
        return g

    # ----- state -----
    def init_layer(self, batch, capacity, num_kv_heads, head_dim):
        gd = self._v_group(head_dim)
        qd, rd = DTYPES[self.qparam_dtype], DTYPES[self.residual_dtype]
        s_k, s_v = self.ring_sizes
        lead = (batch, num_kv_heads)
        k_codes, v_codes, v_qparams = self._stored_shapes(capacity, head_dim, head_dim // gd)
        return KIVILayerState(
            k_codes=jnp.zeros(lead + k_codes, jnp.uint8),
            k_scale=jnp.ones(lead + (capacity // self.group_size, head_dim), qd),
            k_min=jnp.zeros(lead + (capacity // self.group_size, head_dim), qd),
            v_codes=jnp.zeros(lead + v_codes, jnp.uint8),
            v_scale=jnp.ones(lead + v_qparams, qd),
            v_min=jnp.zeros(lead + v_qparams, qd),
            k_res=jnp.zeros(lead + (s_k, head_dim), rd),
            v_res=jnp.zeros(lead + (s_v, head_dim), rd))

    def _stored_shapes(self, capacity: int, head_dim: int, v_groups: int):
        """The layout hook of the allocation: per-layer-and-head shapes of ``k_codes``, ``v_codes`` and the V
        qparams (layout 1: codes ``[C, D*b/8]``, V qparams ``[C, D/Gv]``)."""
        return ((capacity, head_dim * self.k_bits // 8), (capacity, head_dim * self.v_bits // 8),
                (capacity, v_groups))

    def _close(self, codes, scale, mn, ring, new, base, lengths, num_new, n_rows, width, per_channel, row0):
        """Quantize the rows of positions ``[base, base + n_rows)`` (``n_rows <= width``, static ``width``) and
        write their codes and qparams at rows ``position - row0`` (``row0 [B]``: 0, or a window's first position,
        a multiple of G).  Returns the updated arrays and ``bad [B]`` (a hard quantizer flag)."""
        bits = self.k_bits if per_channel else self.v_bits
        win = _rows.window(ring, new, base, lengths, num_new, width)                 # [B, H, W, D] f32
        if per_channel:
            q, status = quantize_affine_with_status(win, bits, axis=2, group_size=self.group_size,
                                                    qparam_dtype=DTYPES[self.qparam_dtype], zero="min")
        else:
            q, status = quantize_affine_with_status(win, bits, axis=3, group_size=self._v_group(win.shape[-1]),
                                                    qparam_dtype=DTYPES[self.qparam_dtype], zero="min")
        narrow, hard = _rows.split_status(status)
        q_scale = _rows.sentinel_scale(q.scale, narrow)
        j = _rows.arange_rows(width)[None, :]
        row_keep = j < n_rows[:, None]
        row = base - row0
        if per_channel:
            g = self.group_size
            gj = _rows.arange_rows(width // g)[None, :]
            keep = gj * g < n_rows[:, None]
            gidx = row[:, None] // g + gj
        else:
            keep, gidx = row_keep, row[:, None] + j
        codes, scale, mn = self._write_closed(codes, scale, mn, q.codes, q_scale, q.zero_or_min,
                                              row[:, None] + j, row_keep, gidx, keep, bits, per_channel)
        return codes, scale, mn, _rows.any_bad_rows(hard, keep)

    def _write_closed(self, codes, scale, mn, u, q_scale, q_min, rows, row_keep, gidx, keep, bits, per_channel):
        """Store closed rows (the layout hook): codes ``u [B, H, W, D]`` at rows ``rows [B, W]`` (where
        ``row_keep``), qparams at rows ``gidx`` (where ``keep``): K groups ``[B, H, W/G, D]`` or V rows
        ``[B, H, W, D/Gv]``.  Layout 1: codes packed along D, qparams row-major."""
        del per_channel
        codes = _rows.write_rows(codes, pack_bits(u, bits, axis=-1), rows, row_keep)
        return codes, _rows.write_rows(scale, q_scale, gidx, keep), _rows.write_rows(mn, q_min, gidx, keep)

    def append_layer_with_status(self, state, lengths, k, v, num_new):
        return self.append_window_with_status(state, lengths, k, v, num_new, jnp.zeros_like(lengths))

    def supports_window_append(self) -> bool:
        return True

    def append_window_with_status(self, state, lengths, k, v, num_new, row0):
        """The append (frontiers, rings and closing windows at TRUE positions); codes and qparams land at rows
        ``position - row0`` of the state (``row0 = 0``: the whole cache; a window's first position otherwise,
        a multiple of ``group_size`` because G divides the page size)."""
        t = k.shape[1]
        g = self.group_size
        s_k, s_v = self.ring_sizes
        rd = DTYPES[self.residual_dtype]
        # every row is first rounded to the residual dtype: the quantizer always sees that value, whether the row
        # closes inside this append or later from the ring (path independence; official KIVI's fp16 residual)
        kt, vt = _rows.head_major(k).astype(rd), _rows.head_major(v).astype(rd)
        after = lengths + num_new
        fk0, fv0 = self.frontiers(lengths)
        fk1, fv1 = self.frontiers(after)
        st = state
        bad = jnp.zeros(lengths.shape, jnp.bool_)

        width_k = ((s_k - 1 + t) // g) * g                      # >= any K frontier growth of this append
        if width_k:
            kc, ks, km, kbad = self._close(st.k_codes, st.k_scale, st.k_min, st.k_res, kt, fk0, lengths, num_new,
                                           fk1 - fk0, width_k, per_channel=True, row0=row0)
            st = st.replace(k_codes=kc, k_scale=ks, k_min=km)
            bad = bad | kbad
        width_v = t if self.residual_rule == "kivi" else ((s_v - 1 + t) // g) * g
        if width_v:
            vc, vs, vm, vbad = self._close(st.v_codes, st.v_scale, st.v_min, st.v_res, vt, fv0, lengths, num_new,
                                           fv1 - fv0, width_v, per_channel=False, row0=row0)
            st = st.replace(v_codes=vc, v_scale=vs, v_min=vm)
            bad = bad | vbad

        k_new, v_new = kt, vt
        st = st.replace(k_res=_rows.ring_write_new(st.k_res, k_new, lengths, num_new, fk1),
                        v_res=_rows.ring_write_new(st.v_res, v_new, lengths, num_new, fv1))
        # rows kept full precision must survive the residual dtype (a finite fp32 row can overflow fp16)
        pos = lengths[:, None] + _rows.arange_rows(t)[None, :]
        valid = _rows.new_row_mask(num_new, t)
        k_fin = jnp.all(jnp.isfinite(k_new), axis=(1, 3)) | (pos < fk1[:, None]) | ~valid
        v_fin = jnp.all(jnp.isfinite(v_new), axis=(1, 3)) | (pos < fv1[:, None]) | ~valid
        ok = rows_finite(k, v, num_new) & ~bad & jnp.all(k_fin & v_fin, axis=1)
        return st, ok

    def append_layer(self, state, lengths, k, v, num_new):
        return self.append_layer_with_status(state, lengths, k, v, num_new)[0]

    def _dequant(self, state, capacity, head_dim):
        g = self.group_size
        n_groups = -(-capacity // g)
        ks, km = state.k_scale, state.k_min
        if ks.shape[2] < n_groups:                                  # capacity % G: the tail never closes
            pad = [(0, 0)] * 2 + [(0, n_groups - ks.shape[2]), (0, 0)]
            ks, km = jnp.pad(ks, pad, constant_values=1), jnp.pad(km, pad)
        k_u, v_u, vs, vm = self._unpacked(state, head_dim)
        kq = dequantize_affine(k_u, ks, km, axis=2, group_size=g, zero="min")
        vq = dequantize_affine(v_u, vs, vm, axis=3, group_size=self._v_group(head_dim), zero="min")
        return kq, vq

    def _unpacked(self, state, head_dim):
        """The layout hook of the readers: unsigned codes ``k_u, v_u [B, H, C, D]`` and the V qparams
        ``[B, H, C, D/Gv]`` (layout 1: as stored)."""
        k_u = unpack_bits(state.k_codes, self.k_bits, axis=-1, count=head_dim)
        v_u = unpack_bits(state.v_codes, self.v_bits, axis=-1, count=head_dim)
        return (k_u, v_u) + self._v_qparams(state)

    def _v_qparams(self, state):
        """The layout hook of the V qparams: ``(v_scale, v_min) [B, H, C, D/Gv]`` (layout 1: as stored)."""
        return state.v_scale, state.v_min

    def _capacity(self, state) -> int:
        """Row capacity ``C`` of a layer state (the layout hook)."""
        return state.k_codes.shape[2]

    def materialize_layer(self, state, lengths):
        capacity = self._capacity(state)
        head_dim = state.k_res.shape[-1]
        kq, vq = self._dequant(state, capacity, head_dim)
        fk, fv = self.frontiers(lengths)
        valid = _rows.valid_rows(lengths, capacity)
        vm = valid[:, None, :, None]

        def combine(quant, ring, frontier):
            out = quant
            if ring.shape[2]:
                out = jnp.where(_rows.rows_below(frontier, capacity), quant, _rows.ring_view(ring, capacity))
            return jnp.where(vm, out, jnp.float32(0))

        return combine(kq, state.k_res, fk), combine(vq, state.v_res, fv), valid

    def sealed_rows(self, lengths):
        """Rows below both frontiers: their codes are written; rows above are (re)written when they close."""
        fk, fv = self.frontiers(np.asarray(lengths, np.int64))
        return np.minimum(fk, fv)

    # ----- truncation -----
    def rebuild_start(self, old_lengths, new_lengths):
        old = np.asarray(old_lengths, np.int64)
        new = np.asarray(new_lengths, np.int64)
        start = new.copy()
        for f_new, f_old in zip(self.frontiers(new), self.frontiers(old)):
            need = f_new < np.minimum(f_old, new)                   # rows [f_new, min(f_old, new)) are codes now
            start = np.where(need, np.minimum(start, f_new), start)
        return start

    def restore_rows_layer(self, state, new_lengths, k, v, start):
        rd = DTYPES[self.residual_dtype]
        fk, fv = self.frontiers(new_lengths)
        return state.replace(
            k_res=_rows.ring_restore(state.k_res, _rows.head_major(k).astype(rd), start, fk, new_lengths),
            v_res=_rows.ring_restore(state.v_res, _rows.head_major(v).astype(rd), start, fv, new_lengths))

    # ----- checks and bytes -----
    def validate_layer(self, state, lengths):
        lengths = np.asarray(jax.device_get(lengths), np.int64)
        fk, fv = self.frontiers(lengths)
        checks.positive_normal("kivi K scale", state.k_scale, lengths, frontier=fk // self.group_size)
        checks.finite_rows("kivi K min", state.k_min, lengths, frontier=fk // self.group_size)
        v_scale, v_min = self._v_qparams(state)
        checks.positive_normal("kivi V scale", v_scale, lengths, frontier=fv)
        checks.finite_rows("kivi V min", v_min, lengths, frontier=fv)
        checks.ring_finite("kivi K residual", state.k_res, fk, lengths)
        checks.ring_finite("kivi V residual", state.v_res, fv, lengths)

    def layer_nbytes(self, state):
        return {"codes": _rows.nbytes(state.k_codes, state.v_codes),
                "qparams": _rows.nbytes(state.k_scale, state.k_min, state.v_scale, state.v_min),
                "residual": _rows.nbytes(state.k_res, state.v_res)}

    def ledger_layer(self, batch, heads, head_dim, rows, *, logical, capacity):
        """K and V counted at their own frontiers (0x04B): codes / qparams of closed rows and groups, residual rows
        still full precision (logical) or the ring slots (physical)."""
        b, h, d, g = batch, heads, head_dim, self.group_size
        gd = self.v_group_size or d
        rb, qb = DTYPE_BYTES[self.residual_dtype], DTYPE_BYTES[self.qparam_dtype]
        s_k, s_v = self.ring_sizes
        if logical:
            fk, fv = (int(f) for f in self.frontiers(rows))
            k_groups, res_k, res_v = fk // g, rows - fk, rows - fv
        else:
            fk = fv = rows
            k_groups, res_k, res_v = capacity // g, s_k, s_v
        return {("codes", "k"): b * h * fk * packed_bytes(d, self.k_bits),
                ("codes", "v"): b * h * fv * packed_bytes(d, self.v_bits),
                ("qparams", "k"): b * h * k_groups * d * 2 * qb,                        # (scale, min) pairs
                ("qparams", "v"): b * h * fv * (d // gd) * 2 * qb,
                ("residual", "k"): b * h * res_k * d * rb,
                ("residual", "v"): b * h * res_v * d * rb}

    # ----- decode attention -----
    def decode_regions(self, state, lengths):
        """The quantized region ``[0, min(fk, fv))`` (K per-channel groups, V per-token) read by the kernel, plus a
        small dense *tail* ``[min(fk, fv), len)`` (at most ``max(S_k, S_v)`` rows) gathered from the residual rings
        and, for positions whose K is already closed but whose V is still in the rolling tail (``[fv, fk)`` under
        the official rule), decoded from the K codes.  The tail is attended in plain JAX, same softmax."""
        st, g = state, self.group_size
        cap = st.k_codes.shape[2]
        fk, fv = self.frontiers(lengths)
        lo = jnp.minimum(fk, fv)
        kq = KVFormat(f"int{self.k_bits}", "channel", "min", g)
        vq = KVFormat(f"int{self.v_bits}", "token", "min", self.v_group_size)
        rows = (cap // g) * g
        k_codes, v_codes, v_scale, v_min = st.k_codes, st.v_codes, st.v_scale, st.v_min
        if rows != cap:   # capacity % G: the last partial group never closes; keep whole groups only
            k_codes, v_codes = k_codes[:, :, :rows], v_codes[:, :, :rows]
            v_scale, v_min = v_scale[:, :, :rows], v_min[:, :, :rows]
        main = Region(k=KVOperand(k_codes, st.k_scale, st.k_min, kq), v=KVOperand(v_codes, v_scale, v_min, vq),
                      start=jnp.zeros_like(lo), end=lo)

        k_t, v_t, nt = self._tail(st, lo, fk, fv)
        tail = region(dense_operand(k_t), dense_operand(v_t), lengths - lo)
        return [main, tail], nt

    def _tail_decodes(self) -> tuple[bool, bool]:
        """``(K, V)``: whether a tail row of that side can lie below its frontier and so be decoded from codes,
        given ``lo = min(fk, fv)`` (both callers of :meth:`_tail`).  A side whose frontier is always ``lo`` reads
        only its ring: "synchronized" (``fk == fv``) both; "kivi" with a residual ``R`` V (``fv = max(len - R, 0)
        <= fk = floor(len / R) R``); "kivi" without one K (``fk = floor(len / G) G <= fv = len``).  A side with no
        ring (``S = 0``: V under "kivi" without a residual) always decodes."""
        if self.residual_rule == "kivi":
            return (True, False) if self.residual else (False, True)
        return False, False

    def _tail(self, state, lo, fk, fv):
        """The dense tail of positions ``[lo, lo + Nt)`` (``Nt = max(S_k, S_v, 1)``, static): ``k_t, v_t float32
        [B, H, Nt, D]`` and ``Nt``.  A position past a frontier reads its ring slot; below it, its decoded codes
        (``[fv, fk)`` under the official rule: K closed, V still in the rolling window).  Rows past the length are
        garbage, masked by the reader.  ``lo`` must be ``min(fk, fv)``: a side that :meth:`_tail_decodes` says
        never decodes reads its ring only, so its code gathers and dequantize are dead code that XLA drops (on an
        H100 they were 2 gathers + 2 transposes of the V codes per decode call under the "kivi" rule, all discarded
        by the select)."""
        st, g = state, self.group_size
        s_k, s_v = self.ring_sizes
        nt = max(s_k, s_v, 1)
        pos = lo[:, None] + _rows.arange_rows(nt)[None, :]                                # [B, Nt]
        row = jnp.minimum(pos, self._capacity(st) - 1)
        grp = jnp.minimum(pos // g, st.k_scale.shape[2] - 1)
        dec_k, dec_v = self._tail_decodes()
        k_t = v_t = None
        if dec_k or dec_v:
            k_t, v_t = self._decoded_rows(st, row, grp)
        if s_k:
            k_ring = _rows.take_rows(st.k_res, pos % s_k).astype(jnp.float32)
            k_t = jnp.where((pos >= fk[:, None])[:, None, :, None], k_ring, k_t) if dec_k else k_ring
        if s_v:
            v_ring = _rows.take_rows(st.v_res, pos % s_v).astype(jnp.float32)
            v_t = jnp.where((pos >= fv[:, None])[:, None, :, None], v_ring, v_t) if dec_v else v_ring
        return k_t, v_t, nt

    def _decoded_rows(self, state, row, grp):
        """The layout hook of the tail: dequantized ``k, v float32 [B, H, W, D]`` of code rows ``row [B, W]`` (K
        qparams of groups ``grp [B, W]``), whatever their frontier."""
        st, d = state, state.k_res.shape[-1]
        kq = KVFormat(f"int{self.k_bits}", "channel", "min", 1)
        vq = KVFormat(f"int{self.v_bits}", "token", "min", self.v_group_size)
        k_rows = KVOperand(_rows.take_rows(st.k_codes, row), _rows.take_rows(st.k_scale, grp),
                           _rows.take_rows(st.k_min, grp), kq)
        v_rows = KVOperand(_rows.take_rows(st.v_codes, row), _rows.take_rows(st.v_scale, row),
                           _rows.take_rows(st.v_min, row), vq)
        return dequantize_operand(k_rows, d, jnp, jnp.float32), dequantize_operand(v_rows, d, jnp, jnp.float32)
