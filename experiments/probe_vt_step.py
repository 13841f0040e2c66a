"""Probe (H200): where does the int4_vt decode step spend its time?  A few LLaMA-3-8B-shaped layers (random bf16
weights), B=8, T rows filled, decode_loop ms/step for int4 (layout 1, Triton) and int4_vt (transposed V, Mosaic
GPU), and the compiled step's HLO ops that produce a V-buffer-sized array (a full-buffer copy/transpose per step
is what must not be there).

    python experiments/probe_vt_step.py [--layers 4] [--T 32768]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_serving as bs  # noqa: E402
from kvquant_jax.cache.registry import make_scheme  # noqa: E402
from kvquant_jax.models.llama import forward  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--schemes", nargs="*", default=["int4", "int4_vt", "bf16"])
    ap.add_argument("--barrier", action="store_true", help="optimization_barrier before the u8 -> s4 bitcast")
    a = ap.parse_args()
    if a.barrier:
        from pallas_kernels import decode_attention_mgpu as mg
        orig = mg._reinterpret
        mg._reinterpret = lambda codes, bits, count: orig(jax.lax.optimization_barrier(codes), bits, count)
    cfg = dataclasses.replace(bs.llama3_8b_shaped(), num_layers=a.layers)
    params = bs.random_params(cfg)
    b, t = 8, a.T
    cap = t + 512
    for spec in a.schemes:
        scheme = make_scheme(spec, rope_theta=cfg.rope_theta, rope_pairing=cfg.rope_pairing)
        cache = bs.filled_cache(cfg, scheme, b, t, cap, "per_layer")
        times, first, _ = bs.time_decode(params, cfg, cache, 16, 3, "auto")
        cache = bs.filled_cache(cfg, scheme, b, t, cap, "per_layer")
        step = jax.jit(lambda p, tk, c: forward(p, cfg, tk, c, attention_impl="auto"), donate_argnums=2)
        hlo = step.lower(params, jnp.zeros((b, 1), jnp.int32), cache).compile().as_text()
        big = []
        for line in hlo.splitlines():
            m = re.search(r"= (\w+)\[([\d,]+)\]", line)
            if m and np.prod([int(x) for x in m.group(2).split(",")]) >= b * 8 * t * 16 and \
                    any(op in line for op in (" copy(", " transpose(", " fusion(", "scatter", "custom-call")):
                big.append(line.strip()[:220])
        print(f"{spec:8s} {a.layers} layers: {np.median(times) * 1e3:.3f} ms/step "
              f"({np.median(times) * 1e3 / a.layers:.3f} ms/layer), compile+first {first:.1f} s; "
              f"{len(big)} big ops in the step:", flush=True)
        for line in big[:6]:
            print("    ", line)
        s4 = [ln.strip()[:200] for ln in hlo.splitlines() if "s4[" in ln and "ENTRY" not in ln]
        print(f"    {len(s4)} HLO lines with s4 arrays:")
        for line in s4[:8]:
            print("    ", line)
        del cache


if __name__ == "__main__":
    main()
