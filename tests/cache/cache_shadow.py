"""An independent NumPy model of every cache scheme, used as the oracle of the cache tests.

The shadow stores the EXACT rows that were appended (float64 copies of the float32 inputs) and, whenever asked,
re-derives what a fresh cache of those rows must hold, from the scheme's documented rules only (module docstrings
of ``kvquant_jax/cache/*.py`` and ``kvquant_jax/quant/*.py``): which rows are quantized at the committed length
(KIVI frontiers), every group's qparams and codes, the residual rows.  The encoders emulate the declared float32
arithmetic with NumPy float32 scalars/arrays (one rounding per operation, ties-to-even), so codes and stored
qparams must agree BIT-EXACTLY; decoded values are formed in float64 from the stored codes and qparams.

Nothing here imports the cache implementation (only scheme objects are inspected for their declared parameters).
"""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

F32 = np.float32
QDT = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "fp32": np.float32}
FP8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def _xla_divides_by_reciprocal() -> bool:
    """XLA's algebraic simplifier may rewrite ``x / constant`` into ``x * (1 / constant)`` (float32 reciprocal,
    then one multiply).  The quantizers divide by constants (``qmax``, ``15``, the FP8 max); the shadow models the
    arithmetic the platform actually executes, probed here once (the two forms differ by one float32 ulp)."""
    import jax
    import jax.numpy as jnp

    x, c = F32(3.8173747), F32(57344)
    got = F32(np.asarray(jax.jit(lambda a: a / jnp.float32(57344.0))(x)))
    if got == x / c:
        return False
    assert got == x * (F32(1) / c), "unexpected float32 division result under jit"
    return True


RECIPROCAL = _xla_divides_by_reciprocal()


def div_const(a, c) -> np.ndarray:
    """float32 ``a / c`` for a compile-time constant ``c``, as executed under jit."""
    a = np.asarray(a, F32)
    return (a * (F32(1) / F32(c))).astype(F32) if RECIPROCAL else (a / F32(c)).astype(F32)


def tiny(dtype) -> float:
    return float(ml_dtypes.finfo(dtype).tiny)


# ---------------------------------------------------------------------------------------------------------------
# number formats (independent re-statements of the declared arithmetic)
# ---------------------------------------------------------------------------------------------------------------
def sym_quant(x: np.ndarray, bits: int, qdt):
    """Symmetric groups along the LAST axis of ``x [..., G]``: returns (q int, stored scale [...], decoded f64)."""
    qmax = 2 ** (bits - 1) - 1
    x32 = x.astype(F32)
    amax = np.max(np.abs(x32), axis=-1)
    nonzero = np.any(x32 != 0, axis=-1)
    ideal = np.where(nonzero, div_const(amax, qmax), F32(1)).astype(F32)
    scale = ideal.astype(qdt)
    eff = scale.astype(F32)
    narrow = nonzero & (eff < tiny(qdt))
    q = np.clip(np.rint(x32 / np.where(eff == 0, F32(1), eff)[..., None]), -qmax, qmax)
    q = np.where((narrow | ~nonzero)[..., None], 0, q).astype(np.int64)
    scale = np.where(narrow, np.ones((), qdt), scale).astype(qdt)
    return q, scale, q * scale.astype(np.float64)[..., None]


def affine_min_quant(x: np.ndarray, bits: int, qdt):
    """Affine ``zero="min"`` groups along the LAST axis: (u, stored scale, stored min, decoded f64)."""
    qm = 2 ** bits - 1
    x32 = x.astype(F32)
    mn, mx = np.min(x32, axis=-1), np.max(x32, axis=-1)
    constant = mx == mn
    width = (mx - mn).astype(F32)
    ideal = np.where(constant, F32(1), div_const(width, qm)).astype(F32)
    scale = ideal.astype(qdt)
    eff = scale.astype(F32)
    narrow = ~constant & (eff < tiny(qdt))
    zmin = mn.astype(qdt)
    zmin = np.where(zmin == 0, np.zeros((), qdt), zmin).astype(qdt)     # documented canonical +0 min
    z = zmin.astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.rint((x32 - z[..., None]) / eff[..., None])
    u = np.where((constant | narrow)[..., None], 0, np.clip(u, 0, qm)).astype(np.int64)
    scale = np.where(narrow, np.ones((), qdt), scale).astype(qdt)
    dec = u * scale.astype(np.float64)[..., None] + zmin.astype(np.float64)[..., None]
    return u, scale, zmin, dec


def qserve_quant(x: np.ndarray):
    """QServe KV4 (sentinel degenerate policy) per vector along the last axis: (u, scale, offset, decoded)."""
    x32 = x.astype(F32)
    mn, mx = np.min(x32, axis=-1), np.max(x32, axis=-1)
    width = (mx - mn).astype(F32)
    constant = width == 0
    ideal = div_const(width, 15)
    scale = np.where(constant, F32(0), ideal).astype(np.float16)
    eff = scale.astype(F32)
    narrow = ~constant & (eff < tiny(np.float16))
    with np.errstate(divide="ignore", invalid="ignore"):
        offset = np.where(constant, F32(0), (-mn / ideal).astype(F32)).astype(F32)
    degenerate = constant | narrow
    scale = np.where(degenerate, np.float16(1), scale).astype(np.float16)
    eff = scale.astype(F32)
    mid = (mn + (width * F32(0.5)).astype(F32)).astype(F32)
    offset = np.where(degenerate, -mid, offset).astype(np.float16)
    off = offset.astype(F32)
    u = np.clip(np.rint((x32 / eff[..., None]).astype(F32) + off[..., None]), 0, 15)
    u = np.where(degenerate[..., None], 0, u).astype(np.int64)
    dec = (u - offset.astype(np.float64)[..., None]) * scale.astype(np.float64)[..., None]
    return u, scale, offset, dec


def fp8_quant(x: np.ndarray, scale: np.ndarray, fmt: str):
    """x ``[H, L, D]`` with per-head scale ``[H]``: (codes fp8, decoded f64)."""
    dt = FP8[fmt]
    hi = F32(float(ml_dtypes.finfo(dt).max))
    s = scale.astype(F32)[:, None, None]
    codes = np.clip((x.astype(F32) / s).astype(F32), -hi, hi).astype(dt)
    return codes, codes.astype(np.float64) * scale.astype(np.float64)[:, None, None]


def fp8_warm_scale(rows: np.ndarray, fmt: str, axis: str) -> np.ndarray:
    """rows ``[n, H, D]`` (all valid rows of the first batch, every sequence) -> float32 ``[H]``."""
    hi = F32(float(ml_dtypes.finfo(FP8[fmt]).max))
    h = rows.shape[1]
    if rows.shape[0] == 0:
        return np.ones(h, F32)
    amax = np.max(np.abs(rows.astype(F32)), axis=(0, 2))
    if axis == "tensor":
        amax = np.full(h, amax.max(), F32)
    return np.where(amax == 0, F32(1), div_const(amax, hi)).astype(F32)


# ---------------------------------------------------------------------------------------------------------------
# KIVI frontiers as specified (kivi.py module doc)
# ---------------------------------------------------------------------------------------------------------------
def kivi_frontiers_spec(length: int, rule: str, r: int, g: int) -> tuple[int, int]:
    if rule == "kivi":
        if r == 0:
            return g * (length // g), length
        return r * (length // r), max(0, length - r)
    over = max(0, length - r)
    q = min(g * (length // g), g * (-(-over // g)))
    return q, q


#: scheme classes with KIVI's quantizer, frontiers and rings (layout 1 and token-planar)
KIVI_CLASSES = ("KIVIScheme", "KIVIPlanarScheme")


def needs_rows_spec(scheme, old: int, new: int) -> int:
    """First position whose original row a truncation ``old -> new`` needs (``new`` when none)."""
    if type(scheme).__name__ not in KIVI_CLASSES:
        return new
    start = new
    for f_new, f_old in zip(kivi_frontiers_spec(new, scheme.residual_rule, scheme.residual, scheme.group_size),
                            kivi_frontiers_spec(old, scheme.residual_rule, scheme.residual, scheme.group_size)):
        if f_new < min(f_old, new):
            start = min(start, f_new)
    return start


# ---------------------------------------------------------------------------------------------------------------
# per-layer expectation: decoded K/V plus the stored representation of the visible region
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Expect:
    k: np.ndarray          # float64 [H, L, D]
    v: np.ndarray
    stored: dict           # name -> array (codes as int64, qparams in their stored dtype) of the visible region


def expect_layer(scheme, k_rows: np.ndarray, v_rows: np.ndarray, fp8_scales=None) -> Expect:
    """What a fresh cache holding ``k_rows, v_rows [L, H, D]`` (float64 of float32 inputs) must store and decode."""
    name = type(scheme).__name__
    kh = np.transpose(k_rows, (1, 0, 2))       # [H, L, D]
    vh = np.transpose(v_rows, (1, 0, 2))
    h, n, d = kh.shape
    if name == "FullPrecisionScheme":
        dt = QDT[scheme.dtype]
        ks, vs = kh.astype(dt), vh.astype(dt)
        return Expect(ks.astype(np.float64), vs.astype(np.float64), {"k": ks, "v": vs})
    if name == "FP8Scheme":
        if fp8_scales is None:                          # a cold warm-up cache: no row, the scale is invisible
            return Expect(kh, vh, {"k": np.zeros((h, 0, d), np.uint8), "v": np.zeros((h, 0, d), np.uint8)})
        k_scale, v_scale = fp8_scales
        kc, kd = fp8_quant(kh, k_scale, scheme.fmt)
        vc, vd = fp8_quant(vh, v_scale, scheme.fmt)
        return Expect(kd, vd, {"k": kc.view(np.uint8), "v": vc.view(np.uint8),
                               "k_scale": k_scale.astype(F32), "v_scale": v_scale.astype(F32)})
    if name == "PerTokenScheme":
        g = scheme.group_size or d
        out, stored = [], {}
        for tag, x in (("k", kh), ("v", vh)):
            q, s, dec = sym_quant(x.reshape(h, n, d // g, g), scheme.bits, QDT[scheme.qparam_dtype])
            out.append(dec.reshape(h, n, d))
            stored[f"{tag}_codes"] = (q + 2 ** (scheme.bits - 1)).reshape(h, n, d)
            stored[f"{tag}_scale"] = s
        return Expect(out[0], out[1], stored)
    if name == "QServeScheme":
        out, stored = [], {}
        for tag, x in (("k", kh), ("v", vh)):
            u, s, o, dec = qserve_quant(x)
            out.append(dec)
            stored.update({f"{tag}_codes": u, f"{tag}_scale": s, f"{tag}_offset": o})
        return Expect(out[0], out[1], stored)
    if name in KIVI_CLASSES:                   # the planar layout stores the same codes and qparams
        g, r, rule = scheme.group_size, scheme.residual, scheme.residual_rule
        qdt, rdt = QDT[scheme.qparam_dtype], QDT[scheme.residual_dtype]
        fk, fv = kivi_frontiers_spec(n, rule, r, g)
        kh, vh = kh.astype(rdt), vh.astype(rdt)          # rows are residual-precision before they close
        k_out = kh.astype(np.float64)
        v_out = vh.astype(np.float64)
        stored = {}
        if fk:
            # K: per (head, channel) over groups of G tokens -> group axis last
            grp = np.transpose(kh[:, :fk].reshape(h, fk // g, g, d), (0, 1, 3, 2))       # [H, nG, D, G]
            u, s, m, dec = affine_min_quant(grp, scheme.k_bits, qdt)
            k_out[:, :fk] = np.transpose(dec, (0, 1, 3, 2)).reshape(h, fk, d)
            stored.update(k_codes=np.transpose(u, (0, 1, 3, 2)).reshape(h, fk, d), k_scale=s, k_min=m)
        if fv:
            gd = scheme.v_group_size or d
            u, s, m, dec = affine_min_quant(vh[:, :fv].reshape(h, fv, d // gd, gd), scheme.v_bits, qdt)
            v_out[:, :fv] = dec.reshape(h, fv, d)
            stored.update(v_codes=u.reshape(h, fv, d), v_scale=s, v_min=m)
        stored["k_res"] = kh[:, fk:].astype(rdt)
        stored["v_res"] = vh[:, fv:].astype(rdt)
        return Expect(k_out, v_out, stored)
    raise TypeError(f"shadow: no model for {name}")


# ---------------------------------------------------------------------------------------------------------------
# the whole-cache shadow
# ---------------------------------------------------------------------------------------------------------------
class ShadowCache:
    """Exact rows per (layer, sequence) plus FP8 warm-up scales; mirrors every state operation."""

    def __init__(self, per_layer_schemes, batch: int, num_kv_heads: int, head_dim: int):
        self.schemes = tuple(per_layer_schemes)
        self.h, self.d = num_kv_heads, head_dim
        self.k = [[np.zeros((0, num_kv_heads, head_dim)) for _ in range(batch)] for _ in self.schemes]
        self.v = [[np.zeros((0, num_kv_heads, head_dim)) for _ in range(batch)] for _ in self.schemes]
        self.scales = [self._initial_scales(s) for s in self.schemes]

    def _initial_scales(self, s):
        if type(s).__name__ != "FP8Scheme":
            return None
        if s.scales == "warmup":
            return None                                   # cold until the first non-empty state
        h = self.h
        ks = np.broadcast_to(np.asarray(s.k_scales or (1.0,), F32), (h,)).astype(F32)
        vs = np.broadcast_to(np.asarray(s.v_scales or (1.0,), F32), (h,)).astype(F32)
        return ks, vs

    def copy(self) -> "ShadowCache":
        out = ShadowCache.__new__(ShadowCache)
        out.schemes, out.h, out.d = self.schemes, self.h, self.d
        out.k = [[a.copy() for a in layer] for layer in self.k]
        out.v = [[a.copy() for a in layer] for layer in self.v]
        out.scales = [None if s is None else (s[0].copy(), s[1].copy()) for s in self.scales]
        return out

    @property
    def batch(self) -> int:
        return len(self.k[0])

    @property
    def lengths(self) -> np.ndarray:
        return np.array([a.shape[0] for a in self.k[0]], np.int64)

    def append(self, layer_kv, num_new):
        warm = self.lengths.any()
        for i, (k, v) in enumerate(layer_kv):
            k, v = np.asarray(k, np.float64), np.asarray(v, np.float64)
            s = self.schemes[i]
            if type(s).__name__ == "FP8Scheme" and s.scales == "warmup" and not warm:
                kr = np.concatenate([k[b, :num_new[b]] for b in range(self.batch)])
                vr = np.concatenate([v[b, :num_new[b]] for b in range(self.batch)])
                self.scales[i] = (fp8_warm_scale(kr, s.fmt, s.scale_axis), fp8_warm_scale(vr, s.fmt, s.scale_axis))
            for b in range(self.batch):
                self.k[i][b] = np.concatenate([self.k[i][b], k[b, :num_new[b]]])
                self.v[i][b] = np.concatenate([self.v[i][b], v[b, :num_new[b]]])

    def fork(self, parents):
        self.k = [[layer[p].copy() for p in parents] for layer in self.k]
        self.v = [[layer[p].copy() for p in parents] for layer in self.v]

    def truncate(self, new_lengths):
        for i in range(len(self.schemes)):
            for b in range(self.batch):
                self.k[i][b] = self.k[i][b][:new_lengths[b]]
                self.v[i][b] = self.v[i][b][:new_lengths[b]]
        for i, s in enumerate(self.schemes):
            if type(s).__name__ == "FP8Scheme" and s.scales == "warmup" and not self.lengths.any():
                self.scales[i] = None                     # every sequence empty: cold again

    def rows_from(self, start, length_to):
        """Per layer (k, v) ``[B, T_r, H, D]`` float32 holding original rows ``[start[b], length_to[b])``."""
        t_r = max(1, int((np.asarray(length_to) - np.asarray(start)).max()))
        out = []
        for i in range(len(self.schemes)):
            ks = np.zeros((self.batch, t_r, self.h, self.d), F32)
            vs = np.zeros_like(ks)
            for b in range(self.batch):
                seg = slice(int(start[b]), int(length_to[b]))
                ks[b, :seg.stop - seg.start] = self.k[i][b][seg]
                vs[b, :seg.stop - seg.start] = self.v[i][b][seg]
            out.append((ks, vs))
        return tuple(out)

    def expect(self, layer: int, b: int) -> Expect:
        return expect_layer(self.schemes[layer], self.k[layer][b], self.v[layer][b], self.scales[layer])
