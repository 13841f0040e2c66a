"""Launch each named fused-RMSNorm variant once at one shape (for Nsight Compute: run under ``ncu -k regex:rmsnorm``).

    ncu --clock-control none -k regex:rmsnorm --section SpeedOfLight --section Occupancy --section LaunchStats \\
        python3 experiments/profile_rmsnorm.py --m 16384 --k 8192 --variants twopass_r1w4,chunk_c1024_r1w4s3

Variants are the ``RMS_VARIANTS`` of ``experiments/bench_w8a8.py``; a bf16 ``x + 1`` copy of the same x is launched
and a Pallas copy are launched first as bandwidth references (add ``-k regex:'rmsnorm|add|copy'`` to include them).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from experiments.bench_w8a8 import RMS_VARIANTS, _pallas_copy  # noqa: E402
from pallas_kernels import rmsnorm_quantize as rq  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--variants", default="twopass_r1w4")
    a = p.parse_args()
    table = dict(RMS_VARIANTS)
    x = jax.random.normal(jax.random.PRNGKey(0), (a.m, a.k), jnp.bfloat16)
    w = jax.random.uniform(jax.random.PRNGKey(1), (a.k,), jnp.float32, 0.5, 1.5).astype(jnp.bfloat16)
    jax.block_until_ready(jax.jit(lambda v: v + jnp.bfloat16(1))(x))  # XLA copy reference
    jax.block_until_ready(jax.jit(_pallas_copy)(x.reshape(-1)))  # Pallas copy reference
    for name in a.variants.split(","):
        out = rq.rmsnorm_quantize(x, w, qparam_dtype=jnp.float16, check=False, **table[name])
        jax.block_until_ready(out)
        print(name, "launched", flush=True)


if __name__ == "__main__":
    main()
