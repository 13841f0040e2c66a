"""Decode attention for one layer of a cache scheme: ask the scheme for its regions, pick kernel or reference.

``decode_attention(q, scheme, layer_state, lengths, k_new, v_new)`` is what the model's decode step calls.  The
layer state is read in place (docs/architecture.md, "Physical layouts"): every scheme owns how it is read
(``CacheScheme.decode_regions(state, lengths) -> (regions, tail_rows)``, region boundaries derived from
``lengths`` with the scheme's own frontier functions; the default is the materialize view as one dense region).
A scheme whose format has its own fused kernel also answers ``fused_decode_operand(state) -> (format, arrays)``;
this module routes by the format's type (:data:`FUSED_KERNELS`: KVQuant's LUT + sparse + in-kernel RoPE kernel; the
Mosaic GPU swap-AB kernel for per-token INT8/INT4 stored in its transposed-V layout; the Mosaic GPU KIVI kernel for
KIVI-2/4 stored token-planar, ``kivi2_planar`` / ``kivi4_planar``, and its per-token-key variant for per-token
INT2/INT4 stored token-planar, ``int2_planar`` / ``int4_planar``).

Which path served each layer is logged once per (path, format, shape) on the ``kvquant_jax.attention`` logger at
trace time (INFO; a WARNING when a GPU falls back to the float materialize path) and kept in :data:`SERVED`.

A token-planar per-token layer (``int2_planar``, ``int4_planar``, ``qserve4_planar``) on a GPU is served by the s8
tensor-core kernel (:mod:`pallas_kernels.decode_attention_mgpu_planar_s8`; measured faster than the bf16 planar
kernel at every timed format, :data:`S8_ROUTE_REASON`) where it reads the layer (at most 8 query heads per KV head),
else by the bf16 planar kernel, the s8 refusal logged as the reason.

Dispatch by measurement (issue J): a transposed-V layer on a GPU (``impl`` "auto" or "kernel") is served by Mosaic
v1 or the warp-specialized Mosaic kernel, whichever the shipped tuning table
(:func:`pallas_kernels.decode_tuning.choose`, written by ``experiments/check_mgpu_decode.py --tune``) measured
fastest at the nearest timed T for (device kind, payload, head_dim, group); its config from the table; v1 default
when the table has no entry or the table's config does not fit this layer (capacity, splits).  A full-precision
(bf16 / fp16) layer read as one region (no small dense tail) is a choice between kernels that read the same rows in
place: Mosaic v1 / ws where the table measured them faster than the Triton region kernel (the table then has a
Mosaic entry for it), the Triton kernel where it has a "triton" entry, no entry, a float32 query or a layer the
Mosaic kernels cannot read (``_dense_route``).  The reason (the table point, or why not) is the logged /
:data:`SERVED` reason.  Formats no Mosaic kernel reads keep the Triton region kernel; the float reference serves a
GPU only with a WARNING.

This module keeps only: the key-stage guard, the scheme's regions (or fused operand), kernel or reference.  The
current token's exact ``k_new, v_new`` join the same softmax.  ``impl``: ``"kernel"`` (Pallas; interpreted on
CPU), ``"reference"`` (float32 JAX, :func:`kvquant_jax.abi.reference.decode_attention_jnp`) or ``"auto"``: the
kernel on a platform that has one for these regions / this format, the reference otherwise (including on CPU, where
the Pallas interpreter would be slow).
"""
from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp

from kvquant_jax.abi.kivi_planar import KiviPlanarFormat
from kvquant_jax.abi.kvquant import KVQuantFormat
from kvquant_jax.abi.reference import decode_attention_jnp
from kvquant_jax.abi.regions import Region
from kvquant_jax.abi.token_planar import TokenPlanarFormat
from kvquant_jax.abi.transposed_v import TransposedVFormat
from pallas_kernels import decode_attention as kernel
from pallas_kernels import decode_attention_kvquant as kvquant_kernel
from pallas_kernels import decode_attention_mgpu as mgpu_kernel
from pallas_kernels import decode_attention_mgpu_kivi as mgpu_kivi_kernel
from pallas_kernels import decode_attention_mgpu_planar as mgpu_planar_kernel
from pallas_kernels import decode_attention_mgpu_planar_s8 as mgpu_planar_s8_kernel
from pallas_kernels import decode_attention_mgpu_ws as ws_kernel
from pallas_kernels import decode_tuning
from pallas_kernels.backend import platform

__all__ = ["decode_attention", "layer_regions", "IMPLS", "FUSED_KERNELS", "SERVED", "S8_ROUTE_REASON"]

IMPLS = ("auto", "kernel", "reference")

_log = logging.getLogger("kvquant_jax.attention")

#: fused decode kernels by static format type: ``(kernel(q, fmt, arrays, lengths, k_new, v_new, *, sm_scale,
#: interpret), platforms that run it natively, unsupported(q, fmt, arrays) -> reason or None)``
FUSED_KERNELS: dict[type, tuple[Any, tuple[str, ...], Any]] = {
    KVQuantFormat: (kvquant_kernel.decode_attention_kvquant, ("gpu",), None),
    TransposedVFormat: (mgpu_kernel.decode_attention_transposed_v, ("gpu",), mgpu_kernel.transposed_v_unsupported),
    KiviPlanarFormat: (mgpu_kivi_kernel.decode_attention_kivi_planar, ("gpu",),
                       mgpu_kivi_kernel.kivi_planar_unsupported),
    TokenPlanarFormat: (mgpu_planar_kernel.decode_attention_token_planar, ("gpu",),
                        mgpu_planar_kernel.token_planar_layer_unsupported),
}

#: ``(path, format description, q shape) -> reason`` for every decode-attention trace so far (what served what)
SERVED: dict[tuple[str, str, tuple[int, ...]], str] = {}


def _served(path: str, what: str, q, reason: str = "") -> None:
    key = (path, what, tuple(q.shape))
    if key in SERVED:
        return
    SERVED[key] = reason
    fallback = path == "reference" and platform() == "gpu"
    (_log.warning if fallback else _log.info)("decode attention: %s served %s, q %s%s", path, what,
                                              tuple(q.shape), f" ({reason})" if reason else "")


def _device_kind() -> str:
    return jax.devices()[0].device_kind


def _transposed_v_route(q, fmt: TransposedVFormat, state) -> tuple[Any, Any, str, str]:
    """``(kernel, config, what, reason)`` for one transposed-V layer on a GPU: the tuning table's choice.

    ``q [B, Hq, D]``; ``state.k_codes [B, Hkv, C, D*b/8]`` (C = capacity rows, the table's bucket key).  The
    kernel is :func:`~pallas_kernels.decode_attention_mgpu.decode_attention_transposed_v` (v1) or
    :func:`~pallas_kernels.decode_attention_mgpu_ws.decode_attention_transposed_v_ws`, looked up at call time;
    ``what`` names the format and capacity for the log."""
    hkv, cap = state.k_codes.shape[1], state.k_codes.shape[2]
    d, g = q.shape[-1], q.shape[1] // hkv
    impl, fields, reason = decode_tuning.choose(_device_kind(), fmt.payload, d, g, cap)
    what = f"{fmt} C={cap}"
    if impl == "mgpu_ws":
        cfg = ws_kernel.MgpuWsConfig(**fields)
        why = ws_kernel.transposed_v_ws_config_unsupported(fmt, state, d, g, cfg)
        if why is None:
            return ws_kernel.decode_attention_transposed_v_ws, cfg, what, reason
        return (mgpu_kernel.decode_attention_transposed_v, None, what,
                f"{reason}, but that ws config does not fit this layer ({why}): v1 default")
    cfg = mgpu_kernel.MgpuConfig(**fields) if fields else None
    why = mgpu_kernel.transposed_v_config_unsupported(fmt, state, d, g, cfg) if cfg is not None else None
    if why:
        return (mgpu_kernel.decode_attention_transposed_v, None, what,
                f"{reason}, but that v1 config does not fit this layer ({why}): v1 default")
    return mgpu_kernel.decode_attention_transposed_v, cfg, what, reason


#: why a token-planar layer on a GPU goes to the s8 kernel (the measurement behind the route)
S8_ROUTE_REASON = ("s8 tensor cores: H100 2026-12-08, T=32768: INT2 73 µs, QServe 111, INT4 108 (today's defaults, "
                   "3 runs) vs 181-192, 185, 179 for the bf16 planar kernel")


def _token_planar_route(q, fmt: TokenPlanarFormat, operand) -> tuple[Any, str]:
    """``(kernel, reason)`` for one token-planar layer on a GPU: the s8 tensor-core kernel
    (:func:`~pallas_kernels.decode_attention_mgpu_planar_s8.decode_attention_token_planar_s8`, faster at every
    timed format) where it reads this layer, else the bf16 planar kernel, with the s8 kernel's refusal as reason.
    ``q [B, Hq, D]``; ``operand`` the layer's :class:`~kvquant_jax.abi.token_planar.TokenPlanarOperand`."""
    why = mgpu_planar_s8_kernel.token_planar_s8_layout_unsupported(q, fmt, operand)
    if why:
        return mgpu_planar_kernel.decode_attention_token_planar, f"s8 kernel refused: {why}: the bf16 planar kernel"
    return mgpu_planar_s8_kernel.decode_attention_token_planar_s8, S8_ROUTE_REASON


def _dense_candidate(regions: list[Region], tail_rows: int, interpret) -> bool:
    """A layer the Mosaic GPU kernels could read in place instead of the Triton region kernel: compiled on a GPU,
    ONE region (no small dense tail), K and V the same bf16 / fp16 payload."""
    if platform() != "gpu" or interpret or len(regions) != 1 or tail_rows:
        return False
    return mgpu_kernel.dense_payload_unsupported(regions[0]) is None


def _dense_route(q, reg: Region) -> tuple[Any, Any, str]:
    """``(kernel, config, reason)`` for one full-precision (bf16 / fp16) region on a GPU, read in place: Mosaic v1
    (:func:`~pallas_kernels.decode_attention_mgpu.decode_attention_mgpu`) or the warp-specialized kernel where the
    tuning table measured it faster than the Triton region kernel; ``kernel`` None: the Triton kernel serves it (no
    table entry: the path it had before it was measured; or the table's winner; or a Mosaic refusal, named)."""
    hkv, cap = reg.k.data.shape[1], reg.k.data.shape[2]
    d, g = q.shape[-1], q.shape[1] // hkv
    why = mgpu_kernel.dense_region_device_unsupported(q)
    if why:
        return None, None, f"Mosaic GPU refused: {why}"
    impl, fields, reason = decode_tuning.choose(_device_kind(), reg.k.fmt.payload, d, g, cap, fallback="triton")
    if impl == "triton":
        return None, None, reason
    if impl == "mgpu_ws":
        cfg = ws_kernel.MgpuWsConfig(**fields)
        why = ws_kernel.dense_region_ws_config_unsupported(reg, g, cfg)
        if why is None:
            return ws_kernel.decode_attention_mgpu_ws, cfg, reason
        reason, fields = f"{reason}, but that ws config does not fit this layer ({why})", {}
    cfg = mgpu_kernel.MgpuConfig(**fields) if fields else None
    why = mgpu_kernel.dense_region_config_unsupported(reg, g, cfg)
    if why and cfg is not None:
        reason, cfg = f"{reason}, but that v1 config does not fit this layer ({why}): v1 default", None
        why = mgpu_kernel.dense_region_config_unsupported(reg, g, None)
    if why:
        return None, None, f"{reason}; Mosaic v1 refused ({why}): the Triton kernel"
    return mgpu_kernel.decode_attention_mgpu, cfg, reason


def _check_key_stage(scheme) -> None:
    if getattr(scheme, "key_stage", "post_rope") != "post_rope" and not scheme.rotates_stored_keys:
        raise ValueError("decode_attention reads post-RoPE keys; a pre-RoPE cache needs the model to rotate the "
                         "decoded keys (use the materialize path)")


def layer_regions(scheme, layer_state, lengths) -> tuple[list[Region], int]:
    """Regions of one layer at committed ``lengths`` plus the row count of its small dense tail (0: none): the
    scheme's own :meth:`~kvquant_jax.cache.interface.CacheScheme.decode_regions` behind the key-stage guard."""
    _check_key_stage(scheme)
    return scheme.decode_regions(layer_state, lengths.astype(jnp.int32))


def _fused(q, scheme, layer_state, lengths, k_new, v_new, impl, interpret, sm_scale, out_dtype):
    """The fused-kernel path: ``(out, None)``; ``(None, None)`` when the scheme has no fused operand or the
    reference is wanted; ``(None, (format, reason))`` when ``impl="auto"`` and the fused kernel refuses this layer
    (the region path then serves it and records the refusal beside the path that did)."""
    operand = scheme.fused_decode_operand(layer_state, lengths.astype(jnp.int32)) if impl != "reference" else None
    if operand is None:
        return None, None
    fmt, arrays = operand
    fused, platforms, unsupported = FUSED_KERNELS[type(fmt)]
    if impl == "auto":
        why = None if platform() in platforms else f"no native {type(fmt).__name__} kernel on {platform()}"
        why = why or (f"head_dim {q.shape[-1]} is not a multiple of 16" if q.shape[-1] % 16 else None)
        why = why or (unsupported(q, fmt, arrays) if unsupported is not None else None)
        if why:
            return None, (str(fmt), f"{getattr(fused, '__name__', 'fused kernel')} refused: {why}")
    kw = {}
    if isinstance(fmt, TransposedVFormat) and platform() == "gpu":
        fused, kw["config"], what, reason = _transposed_v_route(q, fmt, arrays)
        _served(fused.__name__, what, q, reason)
    elif isinstance(fmt, TokenPlanarFormat) and platform() == "gpu":
        fused, reason = _token_planar_route(q, fmt, arrays)
        _served(fused.__name__, str(fmt), q, reason)
    else:
        _served(getattr(fused, "__name__", "fused"), str(fmt), q)
    out = fused(q, fmt, arrays, lengths.astype(jnp.int32), k_new, v_new, sm_scale=sm_scale, interpret=interpret,
                **kw)
    return out.astype(q.dtype if out_dtype is None else out_dtype), None


def decode_attention(q: jax.Array, scheme, layer_state, lengths: jax.Array, k_new: jax.Array | None = None,
                     v_new: jax.Array | None = None, *, impl: str = "auto", interpret: Any = None,
                     backend: str | None = None, config=None, sm_scale: float | None = None,
                     out_dtype=None) -> jax.Array:
    """One decode step's attention for one layer: ``q [B, Hq, D]`` over the cached history and the exact current
    token (``k_new, v_new: [B, Hkv, D]``), one softmax.  Returns ``[B, Hq, D]`` in ``out_dtype`` (default
    ``q.dtype``).

    ``config``: a :class:`pallas_kernels.decode_attention.KernelConfig` for the region kernel path (None:
    defaults).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    _check_key_stage(scheme)
    out, refused = _fused(q, scheme, layer_state, lengths, k_new, v_new, impl, interpret, sm_scale, out_dtype)
    if out is not None:
        return out
    regions, tail_rows = layer_regions(scheme, layer_state, lengths)
    d = q.shape[-1]
    what = f"{regions[0].k.fmt}/{regions[0].v.fmt}"
    # a refused fused kernel is recorded once, with the path that served the layer instead (not as "reference"
    # when the region kernel serves it)
    what, refusal = refused if refused else (what, "")
    if impl == "auto":
        plat = platform()
        why = (f"no region kernel on {plat}" if plat not in ("gpu", "tpu")
               else kernel.kernel_unsupported(regions[0], d, "tpu" if plat == "tpu" else "gpu",
                                              compiled_gpu=plat == "gpu" and not interpret))
        impl = "reference" if why else "kernel"
        if why:
            _served("reference", what, q, "; ".join(x for x in (refusal, why) if x))
    if impl == "kernel" and _dense_candidate(regions, tail_rows, interpret):
        fn, cfg, reason = _dense_route(q, regions[0])
        reason = "; ".join(x for x in (refusal, reason) if x)
        if fn is not None:
            _served(fn.__name__, f"{what} T={regions[0].k.data.shape[2]}", q, reason)
            out = fn(q, regions[0], k_new=k_new, v_new=v_new, sm_scale=sm_scale, config=cfg, out_dtype=out_dtype)
            return out.astype(q.dtype if out_dtype is None else out_dtype)
        refusal = reason
    if impl == "kernel":
        _served("pallas_decode_v1", what, q, refusal)
    if impl == "reference":
        return decode_attention_jnp(q, regions, k_new=k_new, v_new=v_new, sm_scale=sm_scale, out_dtype=out_dtype)
    return kernel.decode_attention(q, regions, k_new=k_new, v_new=v_new, sm_scale=sm_scale, backend=backend,
                                   interpret=interpret, config=config, small_rows=tail_rows, out_dtype=out_dtype)
