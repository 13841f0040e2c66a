"""KVQuant: calibrated per-channel pre-RoPE keys, per-token values, non-uniform codes, dense-and-sparse outliers
and an optional full-precision attention sink (design notes 0x07A-0x07F).

Representation of one row (position ``p``, one KV head; ``D`` = head_dim, ``b_k``/``b_v`` = code widths)
-------------------------------------------------------------------------------------------------------------
Keys (calibrated, never rewritten: 0x05A option 2 / 0x07A).  With ``key_stage="pre_rope"`` (the default) the
stored key is the PRE-RoPE projection ``k = R_p^T k_tilde``; with ``"post_rope"`` (the ablation) it is the rotated
key the model produced.  Per layer and KV head, the calibration fixed ``zero_c`` and ``scale_c`` for every channel
``c`` (the centre and half-width of the calibrated inlier range ``[lo_c, hi_c]``), and one ``2**b_k`` signpost
codebook per layer (:mod:`kvquant_jax.quant.nuq`)::

    x_c    = (k_c - zero_c) / scale_c          normalized; |x_c| <= 1 inside the calibrated range
    code_c = nearest signpost of x_c           (values beyond the codebook clip to an end signpost)
    k_hat_c = codebook[code_c] * scale_c + zero_c

    outliers: |x_c| > 1 (i.e. outside the calibrated per-channel thresholds [lo_c, hi_c]).  Each row keeps at most
    ``k_sparse_capacity`` of them (largest |x_c| first, ties to the lower channel); they are stored as full values.

Values (online, append-local: 0x05B).  The ``v_outliers`` coordinates of largest ``|v|`` in the row (per-row
magnitude threshold: the ``(v_outliers + 1)``-th largest ``|v|``; ties stay dense) go to the sparse path; the
remaining coordinates define ``offset = (max + min) / 2``, ``scale = (max - min) / 2`` (stored in ``qparam_dtype``;
``scale = 0`` is the exact sentinel of a constant or too-narrow row, which decodes to ``offset``), and
``code = nearest signpost of (v - offset) / scale`` in the layer's V codebook.

Sparse semantic: FULL-VALUE REPLACEMENT WITH EXACT HOLES (:mod:`kvquant_jax.quant.sparse`): a kept coordinate
decodes to its stored full value and its dense code is ignored (the dense path is exactly 0 there); nothing is
ever added to an unmasked dense approximation.  Overflow policy (keys only -- values never overflow because the
per-row threshold admits at most ``v_outliers`` coordinates): outliers beyond the row's capacity stay in the
dense path and clip to the end signposts of the codebook (error ``|x| - 1`` in units of ``scale_c``); they are
counted by :func:`key_outlier_overflow` for monitoring.

Sink (0x07E): positions ``p < sink`` are kept unquantized in ``residual_dtype`` (keys in the stored stage) and the
calibration excluded them from every statistic.  Their code rows exist but are never read.

Layout: :class:`kvquant_jax.abi.kvquant.KVQuantLayerState` (the kernel ABI; ``layout_version`` 1, head-major
``[B, Hkv, C, ...]``): packed codes, sparse (uint8 index, value) slots with 255 = unused, per-row V scale / offset,
sink rows, per-row positions, and the unbatched calibrated ``k_scale, k_zero [Hkv, D]`` and codebooks.

The calibrated arrays are part of the layer state, so every layer of a stacked group carries its own values and
the cache stays one pytree.  :func:`load_calibration` writes them (from a
:class:`kvquant_jax.calibration.kvquant.KVQuantCalibration`) into a fresh cache; until then they hold the
"uncalibrated" placeholder (scale 1, zero 0, uniform signposts).

Integration with the model (docs/architecture.md, "KVQuant"): the scheme's INTERFACE is post-RoPE, like every
other scheme: ``append_layer`` receives the model's post-RoPE keys and un-rotates them itself at positions
``lengths + t`` (``apply_rope(..., inverse=True)``, exact up to float32 rounding), and ``materialize_layer``
returns post-RoPE keys, rotating each decoded pre-RoPE key at its stored position.  ``schema.key_stage`` names the
STORED stage (the ABI a kernel and a prefix reuse must agree on); :meth:`KVQuantScheme.decode_stored` is the
stored-stage view.  The Pallas consumer (:mod:`pallas_kernels.decode_attention_kvquant`) reads the codes and
applies RoPE to each cached key inside the kernel.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.cache import _rows, checks
from kvquant_jax.cache.interface import BATCH, HEADS, KVCache, SchemeBase, layer_state, rows_finite
from kvquant_jax.cache.schema import CacheSchema, TensorFormat, require_compatible
from kvquant_jax.abi import kvquant as abi
from kvquant_jax.abi.kvquant import UNUSED, KVQuantFormat, KVQuantLayerState
from kvquant_jax.abi.rope import apply_rope
from kvquant_jax.quant.dtypes import DTYPE_BYTES, DTYPES
from kvquant_jax.quant.ledger import packed_bytes
from kvquant_jax.quant.nuq import nuq_encode, quantize_nuq_with_status
from kvquant_jax.quant.packing import pack_bits
from kvquant_jax.quant.sparse import SparseOutliers, magnitude_thresholds, split_dense_sparse

BITS = (1, 2, 3, 4)               # code widths the kernel's 8-codes-per-chunk unpacking supports
CALIBRATED_FIELDS = ("k_scale", "k_zero", "k_codebook", "v_codebook")


# ----------------------------------------------------------------------------------------------------------------
# Normalization rules shared with the calibration (the codebook must be fit on exactly what the runtime encodes)
# ----------------------------------------------------------------------------------------------------------------
def default_outlier_counts(outlier_fraction: float, head_dim: int) -> tuple[int, int]:
    """``(k_sparse_capacity, v_outliers)`` for a nominal outlier fraction.

    Values: ``round(f * D)`` per row, at least 1 when ``f > 0`` (1 for D=64 at 1%: 1.56% effective).
    Keys: the calibrated per-channel thresholds flag about ``f * D`` coordinates per row on average; the
    capacity ``ceil(3 f D)`` leaves room for rows with more (2 for D=64 at 1%); see the overflow policy.
    """
    if not 0.0 <= outlier_fraction < 1.0:
        raise ValueError(f"outlier_fraction must lie in [0, 1), got {outlier_fraction!r}")
    if outlier_fraction == 0.0:
        return 0, 0
    return (min(head_dim, max(1, math.ceil(3 * outlier_fraction * head_dim - 1e-9))),
            min(head_dim - 1, max(1, round(outlier_fraction * head_dim))))


def normalize_keys(k, zero, scale):
    """``(k - zero) / scale`` in float32 (``zero``, ``scale`` broadcast against ``k``'s last axes)."""
    return (jnp.asarray(k, jnp.float32) - jnp.asarray(zero, jnp.float32)) / jnp.asarray(scale, jnp.float32)


def value_outlier_split(v, v_outliers: int):
    """``(dense_mask, sparse)`` of value rows ``v [..., D]`` under the per-row magnitude rule (``sparse`` is None
    and ``dense_mask`` all-True when ``v_outliers == 0``)."""
    v = jnp.asarray(v, jnp.float32)
    if v_outliers == 0:
        return jnp.ones(v.shape, jnp.bool_), None
    lo, hi = magnitude_thresholds(v, v_outliers, axis=-1)
    split = split_dense_sparse(v, lo, hi, v_outliers, axis=-1)
    return split.dense_mask, split.sparse


def normalize_values(v, v_outliers: int, qparam_dtype: str = "fp16"):
    """The normalized values the runtime V encoder codes, for calibration: ``(x, inlier)`` of ``v [..., D]``.

    ``x = (v - offset) / scale`` with the stored per-row qparams that :func:`kvquant_jax.quant.nuq.quantize_nuq`
    derives from the dense coordinates (the runtime's own call); ``inlier`` is False at sparse coordinates and on
    rows whose stored scale is 0 or rejected (constant / too narrow rows decode to their offset: no code matters).
    """
    v = jnp.asarray(v, jnp.float32)
    mask, sparse = value_outlier_split(v, v_outliers)
    cb = jnp.linspace(-1.0, 1.0, 2, dtype=jnp.float32)          # the qparams do not depend on the codebook
    q, status = quantize_nuq_with_status(v, cb, axis=-1, qparam_dtype=DTYPES[qparam_dtype],
                                         mask=None if sparse is None else mask)
    scale, offset = q.scale.astype(jnp.float32), q.offset.astype(jnp.float32)
    ok = (scale > 0) & (status == 0)
    x = (v - offset) / jnp.where(ok, scale, 1.0)
    return jnp.where(mask & ok, x, 0.0), mask & ok


def _store_sparse(sparse: SparseOutliers | None, x, dtype):
    """:class:`SparseOutliers` of ``x [..., D]`` -> (uint8 indices with 255 unused, values of ``x`` in ``dtype``)."""
    idx = sparse.indices
    used = idx >= 0
    vals = jnp.take_along_axis(x, jnp.maximum(idx, 0), axis=-1)
    return (jnp.where(used, idx, UNUSED).astype(jnp.uint8),
            jnp.where(used, vals, 0.0).astype(dtype))


def key_outlier_overflow(k_pre, k_zero, k_scale, capacity: int):
    """int32 ``[...]``: per-row key outliers (``|x| > 1``) that a capacity of ``capacity`` leaves in the dense
    path (``k_pre [..., Hkv, D]`` with ``k_zero, k_scale [Hkv, D]``).  A monitoring helper for the overflow policy."""
    x = normalize_keys(k_pre, k_zero, k_scale)
    n = jnp.sum(jnp.abs(x) > 1.0, axis=-1, dtype=jnp.int32)
    return jnp.maximum(n - capacity, 0)


# ----------------------------------------------------------------------------------------------------------------
# The scheme
# ----------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KVQuantScheme(SchemeBase):
    """KVQuant cache (see the module docstring).

    Attributes:
      k_bits, v_bits: code widths (1..4; the paper's nuq4 / nuq3 / nuq2 settings).
      k_sparse_capacity: key outlier slots per row (0: dense only; calibrated thresholds then only clip).
      v_outliers: value outliers per row (0: dense only).
      sink: leading positions kept full precision (0 or 1 in the paper).
      qparam_dtype: V scale/offset storage ("fp16" default).
      sparse_dtype: storage of outlier values ("fp16" default, "fp32", "bf16").
      residual_dtype: storage of sink rows ("fp16" default).
      calibration_id: identity of the calibration artifact whose state :func:`load_calibration` installs.
      key_stage: "pre_rope" (default, KVQuant) or "post_rope" (ablation: per-channel state on rotated keys).
    """

    family = "kvquant"
    presets = {"kvquant": {}}        # uncalibrated until load_calibration (configs build it from the artifact)
    aliases = {"bits": ("k_bits", "v_bits")}
    unbatched_fields = CALIBRATED_FIELDS
    rotates_stored_keys = True          # materialize / decode_regions rotate pre-RoPE keys at their positions

    k_bits: int = 4
    v_bits: int = 4
    k_sparse_capacity: int = 0
    v_outliers: int = 0
    sink: int = 0
    qparam_dtype: str = "fp16"
    sparse_dtype: str = "fp16"
    residual_dtype: str = "fp16"
    calibration_id: str = "uncalibrated"
    key_stage: str = dataclasses.field(default="pre_rope", kw_only=True)

    def __post_init__(self):
        checks.choice("kvquant", self, ("k_bits", "v_bits"), BITS, no_bool=True)
        checks.ints_at_least("kvquant", self, ("k_sparse_capacity", "v_outliers", "sink"), 0)
        checks.choice("kvquant", self, ("qparam_dtype", "sparse_dtype", "residual_dtype"), sorted(DTYPES))
        if not self.calibration_id:
            raise ValueError("kvquant: calibration_id must name the calibration artifact (or be 'uncalibrated')")
        self._check_identity()

    # ----- static description -----
    def _extra(self, runtime: bool) -> tuple:
        e = {"codebook": "per_layer_lut_fp32", "k_thresholds": "calibrated_per_channel",
             "v_thresholds": "online_per_token_magnitude", "v_outliers": str(self.v_outliers),
             "sparse": f"replace_exact_holes:uint8_index:{self.sparse_dtype}", "positions": "int32_per_row"}
        if runtime:
            e["k_sparse_capacity"] = str(self.k_sparse_capacity)
        return tuple(sorted(e.items()))

    def _schema(self, runtime: bool) -> CacheSchema:
        key = TensorFormat(payload=f"nuq{self.k_bits}", signed=False, zero="float", axis="channel", group_size=0,
                           qparam_dtype="fp32", qparam_order="scale,zero")
        value = TensorFormat(payload=f"nuq{self.v_bits}", signed=False, zero="float", axis="token", group_size=0,
                             qparam_dtype=self.qparam_dtype, qparam_order="scale,offset")
        ident = self._identity()
        if not runtime:
            ident["kernel_family"] = "any"
        return CacheSchema(scheme="kvquant", key=key, value=value, residual_dtype=self.residual_dtype,
                           sink=self.sink, calibration_id=self.calibration_id, extra=self._extra(runtime), **ident)

    @property
    def schema(self) -> CacheSchema:
        return self._schema(runtime=True)

    @property
    def kernel_format(self) -> KVQuantFormat:
        """The static format a consumer of this layer's arrays needs (:mod:`kvquant_jax.abi.kvquant`)."""
        return KVQuantFormat(k_bits=self.k_bits, v_bits=self.v_bits, k_sparse_capacity=self.k_sparse_capacity,
                             v_outliers=self.v_outliers, sink=self.sink,
                             rope=self.rope_pairing if self.key_stage == "pre_rope" else "none",
                             rope_theta=float(self.rope_theta))

    def calibration_schema(self) -> CacheSchema:
        """The schema fields a calibration artifact is bound to: :attr:`schema` without the runtime-only choices
        (``kernel_family``, ``k_sparse_capacity``: neither changes what the calibration fit)."""
        return self._schema(runtime=False)

    def _check_dims(self, head_dim: int) -> None:
        if head_dim % 8 or head_dim > UNUSED:
            raise ValueError(f"kvquant: head_dim must be a multiple of 8 and <= {UNUSED}, got {head_dim}")
        if self.k_sparse_capacity > head_dim or self.v_outliers >= head_dim:
            raise ValueError(f"kvquant: k_sparse_capacity ({self.k_sparse_capacity}) must be <= head_dim and "
                             f"v_outliers ({self.v_outliers}) < head_dim ({head_dim})")

    # ----- state -----
    def init_layer(self, batch, capacity, num_kv_heads, head_dim):
        self._check_dims(head_dim)
        lead = (batch, num_kv_heads, capacity)
        sd, rd, qd = DTYPES[self.sparse_dtype], DTYPES[self.residual_dtype], DTYPES[self.qparam_dtype]
        return KVQuantLayerState(
            k_codes=jnp.zeros(lead + (head_dim * self.k_bits // 8,), jnp.uint8),
            k_sp_idx=jnp.full(lead + (self.k_sparse_capacity,), UNUSED, jnp.uint8),
            k_sp_val=jnp.zeros(lead + (self.k_sparse_capacity,), sd),
            v_codes=jnp.zeros(lead + (head_dim * self.v_bits // 8,), jnp.uint8),
            v_scale=jnp.zeros(lead + (1,), qd),
            v_offset=jnp.zeros(lead + (1,), qd),
            v_sp_idx=jnp.full(lead + (self.v_outliers,), UNUSED, jnp.uint8),
            v_sp_val=jnp.zeros(lead + (self.v_outliers,), sd),
            k_sink=jnp.zeros((batch, num_kv_heads, self.sink, head_dim), rd),
            v_sink=jnp.zeros((batch, num_kv_heads, self.sink, head_dim), rd),
            pos=jnp.zeros((batch, capacity), jnp.int32),
            k_scale=jnp.ones((num_kv_heads, head_dim), jnp.float32),
            k_zero=jnp.zeros((num_kv_heads, head_dim), jnp.float32),
            k_codebook=jnp.linspace(-1.0, 1.0, 2 ** self.k_bits, dtype=jnp.float32),
            v_codebook=jnp.linspace(-1.0, 1.0, 2 ** self.v_bits, dtype=jnp.float32))

    def _encode_keys(self, k, state):
        """``k [B, H, T, D]`` float32 (stored stage, finite) -> packed codes, sparse idx/val, bad ``[B, H, T]``."""
        x = normalize_keys(k, state.k_zero[None, :, None, :], state.k_scale[None, :, None, :])
        codes = pack_bits(nuq_encode(x, state.k_codebook), self.k_bits, axis=-1)
        sd = DTYPES[self.sparse_dtype]
        if self.k_sparse_capacity == 0:
            return (codes, jnp.zeros(k.shape[:3] + (0,), jnp.uint8), jnp.zeros(k.shape[:3] + (0,), sd),
                    jnp.zeros(k.shape[:3], jnp.bool_))
        split = split_dense_sparse(x, -1.0, 1.0, self.k_sparse_capacity, axis=-1)
        idx, val = _store_sparse(split.sparse, k, sd)
        return codes, idx, val, ~jnp.all(jnp.isfinite(val), axis=-1)

    def _encode_values(self, v, codebook):
        """``v [B, H, T, D]`` float32 (finite) -> codes, scale, offset, sparse idx/val, bad ``[B, H, T]``."""
        mask, sparse = value_outlier_split(v, self.v_outliers)
        q, status = quantize_nuq_with_status(v, codebook, axis=-1, qparam_dtype=DTYPES[self.qparam_dtype],
                                             mask=None if sparse is None else mask)
        narrow, hard = _rows.split_status(status)
        scale = jnp.where(narrow, jnp.zeros((), q.scale.dtype), q.scale)      # sentinel 0: decode to offset
        codes = pack_bits(q.codes, self.v_bits, axis=-1)
        bad = hard[..., 0]
        if sparse is None:
            idx, val = jnp.zeros(v.shape[:3] + (0,), jnp.uint8), jnp.zeros(v.shape[:3] + (0,),
                                                                          DTYPES[self.sparse_dtype])
        else:
            idx, val = _store_sparse(sparse, v, DTYPES[self.sparse_dtype])
            bad = bad | ~jnp.all(jnp.isfinite(val), axis=-1)
        return codes, scale, q.offset, idx, val, bad

    def append_layer_with_status(self, state, lengths, k, v, num_new):
        return self.append_window_with_status(state, lengths, k, v, num_new, jnp.zeros_like(lengths))

    def supports_window_append(self) -> bool:
        return True

    def append_window_with_status(self, state, lengths, k, v, num_new, row0):
        """The append (RoPE inversion, sink rows and stored ``pos`` at TRUE positions); capacity rows land at
        ``position - row0`` (0: the whole cache; a window's first position otherwise)."""
        b, t, h, d = k.shape
        pos = lengths[:, None] + _rows.arange_rows(t)[None, :]                     # [B, T]
        valid = _rows.new_row_mask(num_new, t)
        fin = rows_finite(k, v, num_new)
        k32 = jnp.where(jnp.isfinite(k), k, 0).astype(jnp.float32)               # garbage never reaches a quantizer
        v32 = jnp.where(jnp.isfinite(v), v, 0).astype(jnp.float32)
        if self.key_stage == "pre_rope":
            k32 = apply_rope(k32, pos, self.rope_theta, self.rope_pairing, inverse=True)
        kt, vt = _rows.head_major(k32), _rows.head_major(v32)
        kc, kidx, kval, kbad = self._encode_keys(kt, state)
        vc, vs, vo, vidx, vval, vbad = self._encode_values(vt, state.v_codebook)
        quant = valid & (pos >= self.sink)
        sink_rows = valid & (pos < self.sink)

        row = pos - row0[:, None]

        def w(buf, rows):
            return _rows.write_rows(buf, rows, row, quant)

        st = state.replace(k_codes=w(state.k_codes, kc), k_sp_idx=w(state.k_sp_idx, kidx),
                           k_sp_val=w(state.k_sp_val, kval), v_codes=w(state.v_codes, vc),
                           v_scale=w(state.v_scale, vs), v_offset=w(state.v_offset, vo),
                           v_sp_idx=w(state.v_sp_idx, vidx), v_sp_val=w(state.v_sp_val, vval))
        bad = jnp.any((kbad | vbad) & quant[:, None, :], axis=(1, 2))
        if self.sink:
            rd = DTYPES[self.residual_dtype]
            ks, vs_ = kt.astype(rd), vt.astype(rd)
            st = st.replace(k_sink=_rows.write_rows(st.k_sink, ks, pos, sink_rows),
                            v_sink=_rows.write_rows(st.v_sink, vs_, pos, sink_rows))
            sink_fin = jnp.all(jnp.isfinite(ks) & jnp.isfinite(vs_), axis=(1, 3))  # [B, T]
            bad = bad | jnp.any(sink_rows & ~sink_fin, axis=1)
        bi = jnp.arange(b, dtype=jnp.int32)[:, None]
        st = st.replace(pos=st.pos.at[bi, jnp.where(valid, row, st.pos.shape[1])].set(pos, mode="drop"))
        return st, fin & ~bad

    def append_layer(self, state, lengths, k, v, num_new):
        return self.append_layer_with_status(state, lengths, k, v, num_new)[0]

    # ----- decode -----
    def decode_stored(self, state, lengths):
        """Stored-stage view: ``(k, v, valid, pos)``; ``k`` PRE-RoPE when ``key_stage == "pre_rope"``.

        float32 ``[B, Hkv, C, D]`` twice, bool ``[B, C]``, int32 ``[B, C]``; rows at or past ``lengths`` are zero.
        """
        return abi.decode_stored(self.kernel_format, state, lengths)

    def field_axes(self, state):
        """``[B, Hkv, ...]`` codes, V qparams, sparse outliers and sink rows; ``pos [B, C]`` (batch only); the
        calibrated per-channel ``k_scale, k_zero [Hkv, D]`` (with the heads) and codebooks ``[2^b]`` (replicated)."""
        out = {f: (BATCH, HEADS) + (None,) * (len(getattr(state, f).shape) - 2)
               for f in ("k_codes", "k_sp_idx", "k_sp_val", "v_codes", "v_scale", "v_offset", "v_sp_idx",
                         "v_sp_val", "k_sink", "v_sink")}
        out.update(pos=(BATCH, None), k_scale=(HEADS, None), k_zero=(HEADS, None), k_codebook=(None,),
                   v_codebook=(None,))
        return out

    def materialize_layer(self, state, lengths):
        """POST-RoPE keys (decoded pre-RoPE keys rotated at their stored positions), values, valid rows."""
        return abi.materialize(self.kernel_format, state, lengths)

    # ----- checks and bytes -----
    def validate_layer(self, state, lengths):
        lengths = np.asarray(jax.device_get(lengths), np.int64)
        d = state.k_sink.shape[-1]
        ks = np.asarray(state.k_scale, np.float64)
        if not (np.isfinite(ks).all() and (ks >= np.finfo(np.float32).tiny).all()):
            raise ValueError("kvquant K channel scales must be finite, positive and normal")
        if not np.isfinite(np.asarray(state.k_zero, np.float64)).all():
            raise ValueError("kvquant K channel zeros must be finite")
        for name, cb in (("K", state.k_codebook), ("V", state.v_codebook)):
            c = np.asarray(cb, np.float64)
            if not (np.isfinite(c).all() and (np.diff(c) > 0).all()):
                raise ValueError(f"kvquant {name} codebook must be finite and strictly increasing")
        quant_from = np.minimum(lengths, self.sink)
        pos = np.asarray(state.pos)
        for bi, n in enumerate(lengths):
            if not (pos[bi, :n] == np.arange(n)).all():
                raise ValueError(f"kvquant: sequence {bi} has a row whose stored position is not its logical one")
        for name, idx, val in (("K", state.k_sp_idx, state.k_sp_val), ("V", state.v_sp_idx, state.v_sp_val)):
            ii = np.asarray(idx, np.int64)
            for bi, n in enumerate(lengths):
                rows = ii[bi][:, quant_from[bi]:n]
                used = rows != UNUSED
                if (rows[used] >= d).any():
                    raise ValueError(f"kvquant {name} sparse: sequence {bi} has an outlier index >= head_dim {d}")
                s = np.where(used, rows, d + np.arange(rows.shape[-1]))           # unused slots sort last
                if rows.shape[-1] > 1 and not (np.diff(s, axis=-1) > 0).all():
                    raise ValueError(f"kvquant {name} sparse: sequence {bi} has unsorted or duplicate indices")
            checks.finite_rows(f"kvquant {name} sparse values", val, lengths)
        checks.finite_rows("kvquant V scale", state.v_scale, lengths)
        checks.finite_rows("kvquant V offset", state.v_offset, lengths)
        vs = np.asarray(state.v_scale, np.float64)
        if (vs < 0).any():
            raise ValueError("kvquant V scale must be >= 0 (0 is the constant-row sentinel)")
        if self.sink:
            checks.finite_rows("kvquant K sink", state.k_sink, np.minimum(lengths, self.sink))
            checks.finite_rows("kvquant V sink", state.v_sink, np.minimum(lengths, self.sink))

    def fused_decode_operand(self, state, lengths):
        """``(KVQuantFormat, state)``: the fused LUT + sparse + in-kernel RoPE decode kernel reads the layer as is
        (``pallas_kernels.decode_attention_kvquant``)."""
        del lengths
        return self.kernel_format, state

    def ledger_layer(self, batch, heads, head_dim, rows, *, logical, capacity):
        """Row-wise codes / V qparams / sparse slots / positions for ``rows`` rows; the calibrated per-channel
        state, the codebooks and the ``sink`` rows are allocated whole (so logical == physical at T == C)."""
        b, h, d = batch, heads, head_dim
        sd, rd, qd = (DTYPE_BYTES[x] for x in (self.sparse_dtype, self.residual_dtype, self.qparam_dtype))
        return {("codes", "k"): b * h * rows * packed_bytes(d, self.k_bits),
                ("codes", "v"): b * h * rows * packed_bytes(d, self.v_bits),
                ("qparams", "k"): 2 * h * d * 4 + 4 * 2 ** self.k_bits,        # scale, zero [Hkv, D]; codebook
                ("qparams", "v"): 2 * b * h * rows * qd + 4 * 2 ** self.v_bits,  # scale, offset [.., 1]; codebook
                ("sparse", "k"): b * h * rows * self.k_sparse_capacity * (1 + sd),
                ("sparse", "v"): b * h * rows * self.v_outliers * (1 + sd),
                ("sink_prefix", "k"): b * h * self.sink * d * rd,
                ("sink_prefix", "v"): b * h * self.sink * d * rd,
                ("metadata", "k"): b * rows * 4}                                  # pos: int32 [B, C]

    def layer_nbytes(self, state):
        return {"codes": _rows.nbytes(state.k_codes, state.v_codes),
                "qparams": _rows.nbytes(state.v_scale, state.v_offset, state.k_scale, state.k_zero,
                                        state.k_codebook, state.v_codebook),
                "sparse": _rows.nbytes(state.k_sp_idx, state.k_sp_val, state.v_sp_idx, state.v_sp_val),
                "sink_prefix": _rows.nbytes(state.k_sink, state.v_sink),
                "metadata": _rows.nbytes(state.pos)}


# ----------------------------------------------------------------------------------------------------------------
# Calibration state in and out of a cache
# ----------------------------------------------------------------------------------------------------------------
def load_calibration(cache: KVCache, calibration) -> KVCache:
    """Install per-layer calibrated state into every KVQuant layer of a fresh ``cache``.

    ``calibration``: a :class:`kvquant_jax.calibration.kvquant.KVQuantCalibration` (duck-typed: ``.schema``, the
    :meth:`KVQuantScheme.calibration_schema` it was fit for, and ``.arrays`` with ``k_scale, k_zero [L, Hkv, D]``,
    ``k_codebook [L, 2**k_bits]``, ``v_codebook [L, 2**v_bits]`` indexed by GLOBAL layer).
    Raises :class:`~kvquant_jax.cache.schema.IncompatibleSchemaError` naming every differing schema field (bits,
    sink, key stage, RoPE convention, calibration id, model, tokenizer, ...), and ``ValueError`` when the cache
    already holds rows (new state would reinterpret stored codes) or an array has the wrong shape.
    """
    if np.asarray(jax.device_get(cache.lengths)).any():
        raise ValueError("kvquant.load_calibration: the cache already holds rows; install the calibrated state "
                         "before the first append (changing it would reinterpret stored codes)")
    arrays = calibration.arrays
    groups = list(cache.groups)
    found = False
    for g, (scheme, first, n) in enumerate(cache.schemes):
        if not isinstance(scheme, KVQuantScheme):
            continue
        found = True
        require_compatible(scheme.calibration_schema(), calibration.schema,
                           what=f"KVQuant calibration for layers {first}..{first + n - 1}")
        new = {}
        for name in CALIBRATED_FIELDS:
            arr = np.asarray(arrays[name], np.float32)
            want = (n,) + tuple(getattr(groups[g], name).shape[1:])
            sel = arr[first:first + n]
            if sel.shape != want:
                raise ValueError(f"kvquant.load_calibration: {name} has shape {arr.shape}; layers "
                                 f"{first}..{first + n - 1} need {want[1:]} per layer")
            new[name] = jnp.asarray(sel)
        groups[g] = groups[g].replace(**new)
    if not found:
        raise ValueError("kvquant.load_calibration: the cache has no KVQuant layer")
    out = cache.replace(groups=tuple(groups))
    for layer in range(out.num_layers):     # codebooks sorted, scales positive: refuse a corrupt artifact now
        scheme, st = layer_state(out, layer)
        if isinstance(scheme, KVQuantScheme):
            try:
                scheme.validate_layer(st, out.lengths)
            except ValueError as e:
                raise ValueError(f"kvquant.load_calibration: layer {layer}: {e}") from None
    return out
