"""Wall-clock timing helpers shared by the GPU benchmarks (host-timed; see each benchmark for its method).

``median_seconds(fn, *args, reps)``: compile + one warm-up call, then the median of ``reps`` timed calls, each
synchronized with ``block_until_ready``. ``copy_tbps()`` / ``read_tbps()``: the same run's bandwidth probes,
an elementwise pass over a 2 GiB bf16 buffer (bytes read + written) and a column sum over 4 GiB (bytes read).
"""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def median_seconds(fn, *args, reps: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_tbps(reps: int = 20) -> float:
    """Read + write bandwidth (TB/s) of ``x * 1.0001`` over a 2 GiB bf16 buffer (16 MiB on CPU)."""
    n = (1 << 30) if jax.default_backend() != "cpu" else (1 << 23)
    x = jnp.ones((n,), jnp.bfloat16)
    return 2 * x.nbytes / median_seconds(jax.jit(lambda x: x * jnp.bfloat16(1.0001)), x, reps=reps) / 1e12


def read_tbps(reps: int = 20) -> float:
    """Read-only bandwidth (TB/s): a float32 column sum over a 4 GiB bf16 buffer (32 MiB on CPU)."""
    n = (1 << 31) if jax.default_backend() != "cpu" else (1 << 24)
    x = jnp.ones((n // 4096, 4096), jnp.bfloat16)
    return x.nbytes / median_seconds(jax.jit(lambda x: jnp.sum(x, axis=0, dtype=jnp.float32)), x, reps=reps) / 1e12
