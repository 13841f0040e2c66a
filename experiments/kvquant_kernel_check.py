"""KVQuant decode kernel on the default backend: parity with the plain-JAX twin, compile time, median latency.

On a GPU the kernel is compiled by Pallas Triton (``interpret=False``); elsewhere it runs interpreted (slow: a
correctness check only).  Shapes: B=4 sequences (lengths 1900 / 1000 / 17 / 1), Hkv=8, G=4, D=128, capacity 2048.

    python experiments/kvquant_kernel_check.py            # prints one line per (config, block size)
"""
from __future__ import annotations

import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.cache import ops
from kvquant_jax.cache.interface import init_cache, layer_state
from kvquant_jax.cache.kvquant import KVQuantScheme
from pallas_kernels.backend import default_interpret
from pallas_kernels.decode_attention_kvquant import decode_attention_kvquant, decode_attention_kvquant_reference

CONFIGS = [("half_split", 4, 4, 2, 1, 1, "pre_rope"), ("interleaved", 3, 2, 0, 0, 0, "pre_rope"),
           ("half_split", 2, 3, 1, 2, 1, "post_rope")]


def main() -> int:
    interpret = default_interpret()
    print(f"jax {jax.__version__}, devices {jax.devices()}, interpret={interpret}", flush=True)
    kern = jax.jit(decode_attention_kvquant, static_argnames=("fmt", "interpret", "block_t", "num_splits"))
    ref = jax.jit(decode_attention_kvquant_reference, static_argnames=("fmt",))
    b, h, g, d, c = 4, 8, 4, 128, 2048
    rng = np.random.default_rng(0)
    failed = 0
    for pairing, kb, vb, ck, cv, sink, stage in CONFIGS:
        s = KVQuantScheme(k_bits=kb, v_bits=vb, k_sparse_capacity=ck, v_outliers=cv, sink=sink, rope_theta=1e4,
                          rope_pairing=pairing, key_stage=stage)
        cache = init_cache(s, num_layers=1, batch=b, capacity=c, num_kv_heads=h, head_dim=d)
        k = rng.normal(0, 0.5, (b, 1900, h, d)).astype(np.float32)
        k[:, ::7, :, 3] += 4
        v = rng.normal(0, 1, (b, 1900, h, d)).astype(np.float32)
        cache = ops.append(cache, [(k, v)], np.array([1900, 1000, 17, 1]))
        sch, st = layer_state(cache, 0)
        q = jnp.asarray(rng.normal(0, 1, (b, h * g, d)).astype(np.float32))
        kn = jnp.asarray(rng.normal(0, 1, (b, h, d)).astype(np.float32))
        vn = jnp.asarray(rng.normal(0, 1, (b, h, d)).astype(np.float32))
        r = ref(q, sch.kernel_format, st, cache.lengths, kn, vn).block_until_ready()
        for bt, ns in ((64, 4), (128, 8)):
            label = f"{pairing} k{kb}v{vb} cap{ck}/{cv} sink{sink} {stage} bt{bt} ns{ns}"
            try:
                t0 = time.perf_counter()
                o = kern(q, sch.kernel_format, st, cache.lengths, kn, vn, interpret=interpret, block_t=bt,
                         num_splits=ns).block_until_ready()
                tc = time.perf_counter() - t0
                err = float(jnp.max(jnp.abs(o - r)) / jnp.max(jnp.abs(r)))
                ts, tr = [], []
                for _ in range(20):
                    t0 = time.perf_counter()
                    kern(q, sch.kernel_format, st, cache.lengths, kn, vn, interpret=interpret, block_t=bt,
                         num_splits=ns).block_until_ready()
                    ts.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    ref(q, sch.kernel_format, st, cache.lengths, kn, vn).block_until_ready()
                    tr.append(time.perf_counter() - t0)
                print(f"{label}: rel err {err:.2e}, compile {tc:.1f} s, kernel median {np.median(ts) * 1e3:.3f} ms, "
                      f"plain-JAX twin median {np.median(tr) * 1e3:.3f} ms", flush=True)
                failed += err > 1e-3
            except Exception as e:  # report every config, then fail
                failed += 1
                print(f"{label}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
                traceback.print_exc(limit=4)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
