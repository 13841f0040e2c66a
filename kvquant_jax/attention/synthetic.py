"""Random decode-attention operands in the kernel ABI, for parity tests and the decode benchmark.

Codes are uniform random (every bit pattern of the payload occurs) and qparams are drawn so that decoded values
are O(1), like post-RoPE keys/values.  ``poison=True`` fills rows outside a region's live window (and qparam
groups that cover no live row) with NaN where the format can hold one, so a consumer that lets an unspecified row
reach a dot or a softmax is caught.
"""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from kvquant_jax.abi.regions import KVFormat, KVOperand, PAYLOAD_DTYPES, Region

# Named format pairs (K, V) used by tests and the benchmark.
PRESETS = {
    "fp32": (KVFormat("fp32"), KVFormat("fp32")),
    "bf16": (KVFormat("bf16"), KVFormat("bf16")),
    "fp16": (KVFormat("fp16"), KVFormat("fp16")),
    "e4m3": (KVFormat("e4m3", "head"), KVFormat("e4m3", "head")),
    "e5m2": (KVFormat("e5m2", "head"), KVFormat("e5m2", "head")),
    "int8": (KVFormat("int8", "token", "symmetric"), KVFormat("int8", "token", "symmetric")),
    "int4": (KVFormat("int4", "token", "symmetric"), KVFormat("int4", "token", "symmetric")),
    "int2": (KVFormat("int2", "token", "symmetric"), KVFormat("int2", "token", "symmetric")),
    "qserve": (KVFormat("int4", "token", "offset"), KVFormat("int4", "token", "offset")),
    "static_int4": (KVFormat("int4", "head", "symmetric"), KVFormat("int4", "head", "symmetric")),
}


def kivi_formats(bits: int, k_group: int, v_group: int = 0) -> tuple[KVFormat, KVFormat]:
    """KIVI: K per-channel over ``k_group`` tokens (x = u*s + min), V per-token (``v_group`` elements along D)."""
    return (KVFormat(f"int{bits}", "channel", "min", k_group), KVFormat(f"int{bits}", "token", "min", v_group))


def grouped_formats(bits: int, group: int) -> tuple[KVFormat, KVFormat]:
    """Per-token symmetric INT with ``group`` elements per scale along D (K and V)."""
    f = KVFormat(f"int{bits}", "token", "symmetric", group)
    return f, f


def _live_rows(n, start, end):
    rows = np.arange(n)[None, :]
    return (rows >= np.asarray(start)[:, None]) & (rows < np.asarray(end)[:, None])     # [B, N]


def random_operand(rng: np.random.Generator, fmt: KVFormat, b: int, hkv: int, n: int, d: int, *,
                   start=None, end=None, poison: bool = False, qparam_dtype=jnp.float32) -> KVOperand:
    """Random operand in ``fmt`` with ``n`` rows; with ``poison`` (needs ``start``/``end``) dead rows hold NaN."""
    live = _live_rows(n, start, end) if poison else np.ones((b, n), bool)
    dead = ~live[:, None, :, None]
    if not fmt.is_int:
        x = rng.standard_normal((b, hkv, n, d)).astype(np.float32)
        if fmt.payload in ("e4m3", "e5m2"):
            x = x * 4.0
        if poison:
            x = np.where(dead, np.nan, x)
        data = jnp.asarray(x).astype(PAYLOAD_DTYPES[fmt.payload])
        scale = None
        if fmt.scale == "head":
            scale = jnp.asarray(rng.uniform(0.1, 0.4, (hkv,)).astype(np.float32))
        return KVOperand(data=data, scale=scale, fmt=fmt)
    data = jnp.asarray(rng.integers(0, 256, (b, hkv, n, fmt.data_dim(d)), dtype=np.uint8))
    levels = 2 ** fmt.bits - 1
    if fmt.scale == "head":
        scale = rng.uniform(0.5, 1.5, (hkv,)) * 2.0 / levels
        return KVOperand(data=data, scale=jnp.asarray(scale.astype(np.float32)), fmt=fmt)
    if fmt.scale == "token":
        shape = (b, hkv, n, fmt.token_groups(d))
        group_dead = dead
    else:  # channel: a group row is dead when none of its G rows is live
        shape = (b, hkv, n // fmt.group, d)
        group_dead = ~live.reshape(b, n // fmt.group, fmt.group).any(-1)[:, None, :, None]
    if fmt.zero == "symmetric":
        scale = rng.uniform(0.5, 1.5, shape) * 2.0 / levels
        zero = None
    elif fmt.zero == "offset":          # QServe: x = (u - o) * s, o floating (may leave [0, 15])
        scale = rng.uniform(0.5, 1.5, shape) * 2.0 / levels
        zero = rng.uniform(-2.0, levels + 2.0, shape)
    else:                               # min: x = u * s + m
        scale = rng.uniform(0.5, 1.5, shape) * 2.0 / levels
        zero = rng.uniform(-1.5, -0.5, shape)
    if poison:
        scale = np.where(group_dead, np.nan, scale)
        zero = None if zero is None else np.where(group_dead, np.nan, zero)
    to = lambda a: None if a is None else jnp.asarray(a.astype(np.float32)).astype(qparam_dtype)  # noqa: E731
    return KVOperand(data=data, scale=to(scale), zero=to(zero), fmt=fmt)


def random_region(rng: np.random.Generator, kf: KVFormat, vf: KVFormat, b: int, hkv: int, n: int, d: int,
                  start, end, *, poison: bool = True, qparam_dtype=jnp.float32) -> Region:
    """A region of ``n`` rows with live window ``[start, end)`` (int ``[B]`` each)."""
    start = np.asarray(start, np.int32)
    end = np.asarray(end, np.int32)
    kw = dict(start=start, end=end, poison=poison, qparam_dtype=qparam_dtype)
    return Region(k=random_operand(rng, kf, b, hkv, n, d, **kw), v=random_operand(rng, vf, b, hkv, n, d, **kw),
                  start=jnp.asarray(start), end=jnp.asarray(end))
