"""The one dtype table: storage-dtype names used by schemas, configs and schemes -> JAX dtypes and byte widths."""
from __future__ import annotations

import jax.numpy as jnp

__all__ = ["DTYPES", "DTYPE_BYTES", "float_dtype", "storage_name"]

#: float storage names ("fp32", "bf16", "fp16") -> JAX dtype (K/V rows, residual rings, qparams)
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
#: bytes per element of every storage name a schema records ("none": no storage)
DTYPE_BYTES = {**{n: jnp.dtype(d).itemsize for n, d in DTYPES.items()}, "e4m3": 1, "e5m2": 1, "none": 0}


def float_dtype(name: str):
    """The JAX dtype of a float storage name ("fp32" / "bf16" / "fp16"); a ValueError names the known ones
    (a JAX dtype name such as "bfloat16" is not a storage name: ``storage_name`` converts it)."""
    if name not in DTYPES:
        raise ValueError(f"unknown float storage name {name!r}: one of {sorted(DTYPES)} "
                         f"(storage_name() maps a JAX dtype such as 'bfloat16' to its name)")
    return DTYPES[name]


def storage_name(dtype) -> str:
    """The storage name of a float dtype (``jnp.bfloat16``, ``"bfloat16"``, ``np.float32`` ...) -> "bf16" etc."""
    name = jnp.dtype(dtype).name
    for short, d in DTYPES.items():
        if jnp.dtype(d).name == name:
            return short
    raise ValueError(f"dtype {name!r} has no float storage name (known: "
                     f"{ {k: jnp.dtype(v).name for k, v in DTYPES.items()} })")
