"""The one dtype table: storage-dtype names used by schemas, configs and schemes -> JAX dtypes and byte widths."""
from __future__ import annotations

import jax.numpy as jnp

__all__ = ["DTYPES", "DTYPE_BYTES"]

#: float storage names ("fp32", "bf16", "fp16") -> JAX dtype (K/V rows, residual rings, qparams)
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
#: bytes per element of every storage name a schema records ("none": no storage)
DTYPE_BYTES = {**{n: jnp.dtype(d).itemsize for n, d in DTYPES.items()}, "e4m3": 1, "e5m2": 1, "none": 0}
