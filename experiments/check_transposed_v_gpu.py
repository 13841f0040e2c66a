"""The transposed-V caches (int8_vt / int4_vt, fp8_e4m3_vt / fp8_e5m2_vt) and the token-planar per-token caches
(int2_planar / int4_planar) served by the Mosaic GPU kernels through the dispatcher (Hopper).

    python experiments/check_transposed_v_gpu.py [--T 4096 32768] [--reps 10] [--out DIR]
    python experiments/check_transposed_v_gpu.py --parity-schemes fp8_e4m3_vt fp8_e5m2_vt \
        --schemes fp8_e4m3_vt fp8_e4m3 --T 4096 32768            # FP8: Mosaic (in place) vs Triton (layout 1)
    python experiments/check_transposed_v_gpu.py --parity-schemes int2_planar int4_planar \
        --schemes int2_planar int2 --T 4096 32768                # INT2: the token-planar s8 kernel vs Triton

(a) Parity: ragged random caches built by the scheme's own appends (odd lengths, several appends), GQA 4 and 3,
    D 64 / 128, bf16 and float32 queries, the current token in the same softmax:
    ``attention.dispatch.decode_attention(impl="auto")`` against the float64 oracle on the scheme's materialized
    K/V; a bf16 query must be served by the Mosaic kernel, a float32 one by the float32 reference (the kernel
    would round it to bf16), checked in ``dispatch.SERVED``.
(b) Timing at B=8, Hq=32, Hkv=8, D=128: the same dispatcher call for int4_vt / int8_vt (fp8_*_vt) against the
    layout-1 int4 / int8 (fp8_*) caches (Pallas Triton kernel) and cuDNN bf16, rotating-input-set method of
    ``experiments/bench_decode_attention.py`` (imported), every call including its own scale casts; and the
    one-token append of each scheme (donated, in place).
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode_attention import baseline_fns, hbm_copy_tbps, rel_err, time_program  # noqa: E402
from kvquant_jax.abi.reference import decode_attention_reference  # noqa: E402
from kvquant_jax.abi.regions import dense_operand, region  # noqa: E402
from kvquant_jax.attention import dispatch  # noqa: E402
from kvquant_jax.cache.registry import make_scheme  # noqa: E402


def filled_state(scheme, key, b, hkv, t, d, lengths, chunks=1):
    st = scheme.init_layer(b, t, hkv, d)
    done = jnp.zeros((b,), jnp.int32)
    step = -(-t // chunks)
    for c in range(chunks):
        kk = jax.random.fold_in(key, c)
        k = jax.random.normal(kk, (b, step, hkv, d), jnp.float32)
        v = jax.random.normal(jax.random.fold_in(kk, 1), (b, step, hkv, d), jnp.float32)
        n = jnp.clip(jnp.asarray(lengths, jnp.int32) - done, 0, step)
        st = jax.jit(scheme.append_layer)(st, done, k, v, n)
        done = done + n
    return st, done


#: the dispatcher entry that must serve each layout's layers on a Hopper GPU, and whether it serves float32 queries
#: (token-planar: the s8 tensor-core kernel, every parity shape here has <= 8 query heads per KV head)
MOSAIC_ENTRY = {"TransposedVFormat": ("decode_attention_transposed_v", False),
                "TokenPlanarFormat": ("decode_attention_token_planar_s8", True)}


def parity(rows, log, names=("int8_vt", "int4_vt")):
    key = jax.random.PRNGKey(0)
    for name in names:
        scheme = make_scheme(name)
        # the last two at the capacities the tuning table keys (4K, 32K rows at D 128, G 4): there the table may
        # route to the warp-specialized kernel (``SERVED`` names which one served)
        for (b, hkv, g, d, t) in ((3, 2, 4, 128, 512), (2, 3, 3, 64, 384), (4, 8, 4, 128, 1024),
                                  (2, 8, 4, 128, 4096), (2, 8, 4, 128, 32768)):
            blk = getattr(scheme, "block_t", 1)                  # token-planar capacities: whole blocks
            t = -(-t // blk) * blk
            lengths = [t - 1, t // 3 + 1, 129, 7][:b]
            st, L = filled_state(scheme, jax.random.fold_in(key, t + d), b, hkv, t, d, lengths, chunks=3)
            k, v, _ = scheme.materialize_layer(st, L)
            for qd in (jnp.bfloat16, jnp.float32):
                q = jax.random.normal(jax.random.fold_in(key, 5), (b, hkv * g, d), jnp.float32).astype(qd)
                kn = jax.random.normal(jax.random.fold_in(key, 6), (b, hkv, d), jnp.float32)
                vn = jax.random.normal(jax.random.fold_in(key, 7), (b, hkv, d), jnp.float32)
                dispatch.SERVED.clear()
                out = jax.jit(lambda q, st, L, kn, vn: dispatch.decode_attention(q, scheme, st, L, kn, vn, out_dtype=jnp.float32))(
                    q, st, L, kn, vn)
                served = sorted({p for p, *_ in dispatch.SERVED})
                want = decode_attention_reference(np.asarray(q.astype(jnp.float32)),
                                                  [region(dense_operand(k), dense_operand(v), L)],
                                                  k_new=np.asarray(kn), v_new=np.asarray(vn))
                err = rel_err(out.astype(jnp.float32), want)
                # transposed-V: bf16 queries the Mosaic kernel (exact q); float32 queries refused by the kernel (it
                # would round q to bf16, ~1e-3) and served by the float32 reference, keeping float32 models at
                # float32 parity.  Token-planar: the kernel serves both (q' as bf16 hi + lo parts, ~1e-5)
                entry, f32_too = MOSAIC_ENTRY[type(scheme.kernel_format).__name__]
                mosaic = any(p.startswith(entry) for p in served)                       # v1 or ws (table)
                want_mosaic = qd == jnp.bfloat16 or f32_too
                ok = err < (1e-5 if qd == jnp.float32 and not f32_too else 1e-4) and mosaic == want_mosaic
                rows.append(dict(kind="parity", scheme=name, B=b, Hkv=hkv, G=g, D=d, T=t, q=jnp.dtype(qd).name,
                                 rel_err=err, served=served, ok=bool(ok)))
                log(f"parity {name:8s} B{b} Hkv{hkv} G{g} D{d} T{t} q={jnp.dtype(qd).name:8s} "
                    f"rel err {err:.2e} served {served} {'ok' if ok else 'FAIL'}")


def append_us(scheme, st, b, hkv, d, reps=50):
    f = jax.jit(lambda st, L, k, v: scheme.append_layer(st, L, k, v, jnp.ones((b,), jnp.int32)), donate_argnums=0)
    # rows: the FP8 layout-1 state holds ``k``; token-planar codes hold 8/bits tokens per byte row (scales: one each)
    cap = (st.k_scale.shape[-1] if hasattr(scheme, "block_t") else
           (st.k_codes if hasattr(st, "k_codes") else st.k).shape[2])
    L = jnp.full((b,), cap // 2 + 1, jnp.int32)
    k = jnp.ones((b, 1, hkv, d), jnp.bfloat16)
    st = f(st, L, k, k)
    jax.block_until_ready(st)
    t0 = time.perf_counter()
    for _ in range(reps):
        st = f(st, L, k, k)
    jax.block_until_ready(st)
    return (time.perf_counter() - t0) / reps * 1e6


def timing(args, rows, log):
    b, hq, hkv, d = 8, 32, 8, 128
    key = jax.random.PRNGKey(1)
    for t in args.T:
        q = jax.random.normal(key, (b, hq, d), jnp.float32).astype(jnp.bfloat16)
        base = None
        sets = [(jax.random.normal(jax.random.fold_in(key, i), (b, t, hkv, d), jnp.bfloat16),
                 jax.random.normal(jax.random.fold_in(key, 50 + i), (b, t, hkv, d), jnp.bfloat16))
                for i in range(max(2, int(np.ceil(2e9 / (4 * b * t * hkv * d)))))]
        med, lo, hi, _ = time_program(baseline_fns()["cudnn"], q, sets, args.reps)
        base = med
        rows.append(dict(kind="time", T=t, scheme="cudnn bf16", us=med * 1e6, us_min=lo * 1e6, us_max=hi * 1e6))
        log(f"T={t:6d} cudnn bf16   {med * 1e6:8.1f} us [{lo * 1e6:.1f}, {hi * 1e6:.1f}]")
        del sets
        for name in args.schemes:
            scheme = make_scheme(name)
            lengths = jnp.full((b,), t, jnp.int32)
            st0, L = filled_state(scheme, jax.random.fold_in(key, 7), b, hkv, t, d, [t] * b, chunks=4)
            nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(st0))
            n = max(2, int(np.ceil(512e6 / nbytes)))
            sets = [st0] + [jax.tree.map(lambda a, i=i: a ^ jnp.asarray(i, a.dtype) if a.dtype == jnp.uint8
                                         else jnp.array(a, copy=True), st0) for i in range(1, n)]
            dispatch.SERVED.clear()
            fn = lambda q, st, scheme=scheme: dispatch.decode_attention(q, scheme, st, lengths)  # noqa: E731
            med, lo, hi, _ = time_program(fn, q, sets, args.reps)
            served = sorted({p for p, *_ in dispatch.SERVED})
            del sets
            app = append_us(scheme, st0, b, hkv, d)
            rows.append(dict(kind="time", T=t, scheme=name, us=med * 1e6, us_min=lo * 1e6, us_max=hi * 1e6,
                             bytes=nbytes, tbps=nbytes / med / 1e12, speedup_vs_cudnn=base / med, served=served,
                             append_us=app))
            log(f"T={t:6d} {name:12s} {med * 1e6:8.1f} us [{lo * 1e6:.1f}, {hi * 1e6:.1f}] "
                f"{nbytes / med / 1e12:5.2f} TB/s  x{base / med:.2f} vs cuDNN  served {served}  "
                f"one-token append {app:.1f} us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="*", default=[4096, 32768])
    ap.add_argument("--schemes", nargs="*", default=["int4_vt", "int4", "int8_vt", "int8"])
    ap.add_argument("--parity-schemes", nargs="*", default=["int8_vt", "int4_vt"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-parity", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    rows = []
    log = functools.partial(print, flush=True)
    log(f"{jax.devices()[0].device_kind} JAX {jax.__version__} {datetime.date.today()}; "
        f"copy probe {hbm_copy_tbps():.2f} TB/s")
    if not args.no_parity:
        parity(rows, log, args.parity_schemes)
    timing(args, rows, log)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "transposed_v.json"), "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                           date=str(datetime.date.today()), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
