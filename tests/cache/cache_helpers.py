"""Shared fixtures of the cache tests: the scheme cases, tiny shapes, row generators and the shadow comparison.

All tests use the same shapes and scheme objects so every jitted cache function compiles once per process.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.cache import mixed, ops
from kvquant_jax.cache.fp8 import FP8Scheme
from kvquant_jax.cache.full import FullPrecisionScheme
from kvquant_jax.cache.interface import init_cache
from kvquant_jax.cache.kivi import KIVIScheme
from kvquant_jax.cache.kivi_planar import KIVIPlanarScheme
from kvquant_jax.cache.per_token import PerTokenScheme
from kvquant_jax.cache.qserve import QServeScheme

from cache_shadow import KIVI_CLASSES, ShadowCache, kivi_frontiers_spec

L, B, H, D, C = 2, 3, 2, 8, 24
T_PREFILL = 5                  # static row count of every multi-row append in the tests


def _uniform(s):
    return mixed.uniform(s, L)


CASES = {
    "fp32": _uniform(FullPrecisionScheme("fp32")),
    "bf16": _uniform(FullPrecisionScheme("bf16")),
    "fp8_e4m3_unit": _uniform(FP8Scheme("e4m3")),
    "fp8_e5m2_warmup_head": _uniform(FP8Scheme("e5m2", scales="warmup", scale_axis="head")),
    "fp8_e4m3_calibrated_skip0": mixed.skip_layers(
        FP8Scheme("e4m3", scales="calibrated", scale_axis="head", k_scales=(0.01, 0.02), v_scales=(0.015, 0.005),
                  calibration_id="test-artifact-1"), L, layers=[0]),
    "int8": _uniform(PerTokenScheme(bits=8)),
    "int4_g4": _uniform(PerTokenScheme(bits=4, group_size=4)),
    "qserve4": _uniform(QServeScheme()),
    "kivi2_official": _uniform(KIVIScheme(k_bits=2, v_bits=2, group_size=4, v_group_size=4, residual=8)),
    "kivi4_sync": _uniform(KIVIScheme(k_bits=4, v_bits=4, group_size=4, v_group_size=0, residual=8,
                                      residual_rule="synchronized", residual_dtype="fp32")),
    "kivi2_official_r0": _uniform(KIVIScheme(k_bits=2, v_bits=4, group_size=4, v_group_size=8, residual=0)),
    "kivi2_sync_r0": _uniform(KIVIScheme(k_bits=2, v_bits=2, group_size=4, v_group_size=4, residual=0,
                                         residual_rule="synchronized")),
    # token-planar KIVI with 1-row planes (4-token blocks, C a multiple): bytes shared by 4 positions
    "kivi2_planar_sync": _uniform(KIVIPlanarScheme(k_bits=2, v_bits=2, group_size=4, v_group_size=4, residual=8,
                                                   residual_rule="synchronized", plane_rows=1)),
}


@functools.lru_cache(maxsize=None)
def new_cache(policy, batch: int = B, capacity: int = C):
    """A fresh cache (memoized: cache values are immutable, so every test may start from the same one)."""
    return init_cache(policy, num_layers=L, batch=batch, capacity=capacity, num_kv_heads=H, head_dim=D)


def rows(rng: np.random.Generator, t: int, kind: str = "normal", batch: int = B):
    """Per-layer (k, v) float32 ``[B, t, H, D]``.  ``kind`` stresses the quantizers' special groups."""
    out = []
    for _ in range(L):
        pair = []
        for _ in range(2):
            x = rng.standard_normal((batch, t, H, D)).astype(np.float32) * np.float32(rng.uniform(0.2, 3.0))
            if kind == "mixed":
                x += np.float32(rng.normal(0, 2.0))                        # offset: exercises affine mins
                sel = rng.random((batch, t, H)) < 0.2
                x[sel] = np.float32(rng.normal())                          # constant head vectors
                sel = rng.random((batch, t, H)) < 0.1
                x[sel] *= np.float32(1e-6)                                 # too narrow for fp16 qparams
                sel = rng.random((batch, t, H)) < 0.1
                x[sel] = 0                                                 # all-zero vectors
            pair.append(x)
        out.append(tuple(pair))
    return tuple(out)                      # tuples everywhere: one jit cache entry per shape


def unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Little-endian bit stream along the last axis (independent of kvquant_jax.quant.packing)."""
    stream = np.unpackbits(packed.astype(np.uint8), axis=-1, bitorder="little")
    stream = stream[..., : count * bits].reshape(packed.shape[:-1] + (count, bits)).astype(np.int64)
    return (stream << np.arange(bits)).sum(axis=-1)


def unpack_planar(packed: np.ndarray, bits: int, plane_rows: int) -> np.ndarray:
    """Token-planar bytes ``[H, NR, X]`` -> codes ``[H, NR * 8/bits, X]`` int64, from the documented layout
    (docs/architecture.md, kivi_planar): row t at byte row ``(t // BT) * plane_rows + t % plane_rows``, bits
    ``[bits * plane, bits * (plane + 1))`` with ``plane = (t % BT) // plane_rows``, the top plane XOR
    ``2^(bits-1)``."""
    p = 8 // bits
    bt = plane_rows * p
    t = np.arange(packed.shape[1] * p)
    plane = (t % bt) // plane_rows
    byte = packed.astype(np.int64)[:, (t // bt) * plane_rows + t % plane_rows]            # [H, T, X]
    u = (byte >> (bits * plane)[None, :, None]) & ((1 << bits) - 1)
    return u ^ np.where(plane == p - 1, 1 << (bits - 1), 0)[None, :, None]


def physical(scheme, st, n: int) -> dict:
    """The stored representation of the visible region of one layer / one sequence (``st``: arrays ``[H, ...]``).
    Read straight from the documented layout (docs/architecture.md)."""
    name = type(scheme).__name__
    g = {k: np.asarray(getattr(st, k)) for k in st.__dataclass_fields__}
    if name == "FullPrecisionScheme":
        return {"k": g["k"][:, :n], "v": g["v"][:, :n]}
    if name == "FP8Scheme":
        return {"k": g["k"][:, :n].view(np.uint8), "v": g["v"][:, :n].view(np.uint8),
                "k_scale": g["k_scale"], "v_scale": g["v_scale"]}
    if name == "PerTokenScheme":
        return {"k_codes": unpack(g["k_codes"][:, :n], scheme.bits, D), "k_scale": g["k_scale"][:, :n],
                "v_codes": unpack(g["v_codes"][:, :n], scheme.bits, D), "v_scale": g["v_scale"][:, :n]}
    if name == "QServeScheme":
        return {f"{t}_{f}": (unpack(g[f"{t}_codes"][:, :n], 4, D) if f == "codes" else g[f"{t}_{f}"][:, :n])
                for t in "kv" for f in ("codes", "scale", "offset")}
    if name in KIVI_CLASSES:
        gs = scheme.group_size
        fk, fv = kivi_frontiers_spec(n, scheme.residual_rule, scheme.residual, gs)
        if name == "KIVIPlanarScheme":        # codes token-planar, V and its qparams transposed: back to layout 1
            k_codes = unpack_planar(g["k_codes"], scheme.k_bits, scheme.plane_rows)
            v_codes = unpack_planar(np.swapaxes(g["v_codes"], 1, 2), scheme.v_bits, scheme.plane_rows)
            v_scale, v_min = (np.ascontiguousarray(np.swapaxes(g[f], 1, 2)) for f in ("v_scale", "v_min"))
        else:
            k_codes, v_codes = unpack(g["k_codes"], scheme.k_bits, D), unpack(g["v_codes"], scheme.v_bits, D)
            v_scale, v_min = g["v_scale"], g["v_min"]
        out = {}
        if fk:
            out.update(k_codes=k_codes[:, :fk], k_scale=g["k_scale"][:, :fk // gs], k_min=g["k_min"][:, :fk // gs])
        if fv:
            out.update(v_codes=v_codes[:, :fv], v_scale=v_scale[:, :fv], v_min=v_min[:, :fv])
        for t, f in (("k", fk), ("v", fv)):
            ring = g[f"{t}_res"]
            out[f"{t}_res"] = ring[:, np.arange(f, n) % max(ring.shape[1], 1)] if n > f else ring[:, :0]
        return out
    raise TypeError(name)


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint8) if a.dtype != np.int64 else a


def _close(actual, desired, tag):
    """float32 decode of exactly stored values vs the float64 shadow: a few float32 roundings apart at most."""
    if actual.shape == desired.shape and np.allclose(actual, desired, rtol=2e-7, atol=1e-30):
        return
    np.testing.assert_allclose(actual, desired, rtol=2e-7, atol=1e-30, err_msg=tag)


def assert_matches_shadow(cache, shadow: ShadowCache, where: str = "") -> None:
    """Decoded K/V == shadow (float32 decode of exact stored values), stored codes/qparams bit-exact, lengths and
    frontiers consistent, and every invariant of ops.validate."""
    lengths = np.asarray(cache.lengths)
    np.testing.assert_array_equal(lengths, shadow.lengths, err_msg=f"{where}: lengths")
    ops.validate(cache)
    groups, decoded = jax.device_get((cache.groups, ops.decode_all(cache)))
    for layer in range(L):
        scheme = cache.scheme_for_layer(layer)
        assert scheme == shadow.schemes[layer]
        k, v, valid = decoded[layer]
        assert np.array_equal(valid, np.arange(C)[None, :] < lengths[:, None]), f"{where}: valid mask"
        gi = next(i for i, (_, first, n) in enumerate(cache.schemes) if first <= layer < first + n)
        first = cache.schemes[gi][1]
        for b in range(shadow.batch):
            n = int(lengths[b])
            exp = shadow.expect(layer, b)
            tag = f"{where}: layer {layer} seq {b} ({type(scheme).__name__})"
            _close(k[b, :, :n], exp.k, tag + " K")
            _close(v[b, :, :n], exp.v, tag + " V")
            assert not k[b, :, n:].any() and not v[b, :, n:].any(), tag + ": rows past the length are not zero"
            got = physical(scheme, jax_tree_index(groups[gi], layer - first, b, scheme), n)
            if type(scheme).__name__ == "FP8Scheme" and "k_scale" not in exp.stored:
                assert not lengths.any(), tag + ": shadow has no warm-up scale although rows exist"
                got = {key: val for key, val in got.items() if not key.endswith("scale")}
            assert set(got) == set(exp.stored), (tag, sorted(got), sorted(exp.stored))
            for key, e in exp.stored.items():
                a = np.asarray(got[key])
                assert a.shape == e.shape, f"{tag} {key}: shape {a.shape} != {e.shape}"
                assert a.dtype == np.int64 or a.dtype == e.dtype, f"{tag} {key}: dtype {a.dtype} != {e.dtype}"
                assert np.array_equal(_bits(a), _bits(np.asarray(e).astype(a.dtype))), \
                    f"{tag} {key}: stored bits differ"
        if type(scheme).__name__ in KIVI_CLASSES:
            fk, fv = scheme.frontiers(lengths)
            for b in range(shadow.batch):
                assert (int(fk[b]), int(fv[b])) == kivi_frontiers_spec(
                    int(lengths[b]), scheme.residual_rule, scheme.residual, scheme.group_size), f"{where}: frontier"


class _View:
    """Attribute view of one layer / one sequence of a host-side group state."""

    def __init__(self, fields):
        self.__dict__.update(fields)
        self.__dataclass_fields__ = fields


def jax_tree_index(group_state, layer: int, b: int, scheme):
    """The arrays of one layer and one sequence as NumPy (unbatched fields kept whole)."""
    fields = {}
    for name in group_state.__dataclass_fields__:
        a = np.asarray(getattr(group_state, name))[layer]
        fields[name] = a if name in scheme.unbatched_fields else a[b]
    return _View(fields)


#: the ragged append schedule of the layout-twin tests: (rows per call, valid rows per sequence of a 3-sequence
#: batch); odd lengths, empty and one-row appends, so byte-shared V columns and ragged frontiers both occur
RAGGED_APPENDS = ((5, (5, 3, 0)), (1, (1, 1, 1)), (4, (2, 4, 3)), (1, (1, 0, 1)), (7, (7, 6, 5)))


def ragged_twins(schemes, batch: int, heads: int, head_dim: int, capacity: int, seed: int = 0):
    """The same :data:`RAGGED_APPENDS` (K ~ N(0, 1.5), V ~ N(0, 0.7)) appended into each scheme of ``schemes``
    (layout twins: e.g. a transposed-V scheme and its layout-1 original); returns ``(states, lengths)``."""
    rng = np.random.default_rng(seed)
    states = [sc.init_layer(batch, capacity, heads, head_dim) for sc in schemes]
    lengths = jnp.zeros((batch,), jnp.int32)
    for t, nn in RAGGED_APPENDS:
        k = rng.normal(0, 1.5, (batch, t, heads, head_dim)).astype(np.float32)
        v = rng.normal(0, 0.7, (batch, t, heads, head_dim)).astype(np.float32)
        nn = jnp.asarray(nn[:batch], jnp.int32)
        states = [sc.append_layer(st, lengths, k, v, nn) for sc, st in zip(schemes, states)]
        lengths = lengths + nn
    return states, lengths
