"""Probe (H200): can a decode step append one token into an int4 cache buffer in place?

The Mosaic GPU decode kernel (pallas_kernels/decode_attention_mgpu.py) wants int4 K rows ``[BH, T, D]`` and V
transposed ``[BH, D, T]`` (tokens contiguous).  This times, with the buffer donated, (a) a K row write into an
``s4 [BH, T, D]`` buffer, (b) a V column write into ``s4 [BH, D, T]`` at an odd token, (c) the same column as a
nibble read-modify-write of a ``uint8 [BH, D, T/2]`` buffer, against (d) a full elementwise pass over the buffer,
and prints whether the compiled HLO converts the whole buffer (an ``s8`` copy) around the update.

    python experiments/probe_subbyte_append.py [--bh 64 --t 32768 --d 128]
"""
from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp


def _time(f, *args, reps=20):
    out = f(*args)
    jax.block_until_ready(out)
    args = (out,) + args[1:]
    t0 = time.perf_counter()
    for _ in range(reps):
        args = (f(*args),) + args[1:]
    jax.block_until_ready(args[0])
    return (time.perf_counter() - t0) / reps * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bh", type=int, default=64)
    ap.add_argument("--t", type=int, default=32768)
    ap.add_argument("--d", type=int, default=128)
    a = ap.parse_args()
    bh, t, d = a.bh, a.t, a.d
    pos = jnp.int32(t // 2 + 1)

    @functools.partial(jax.jit, donate_argnums=0)
    def k_row(buf, row, p):
        return jax.lax.dynamic_update_slice(buf, row[:, None, :], (0, p, 0))

    @functools.partial(jax.jit, donate_argnums=0)
    def v_col(buf, col, p):
        return jax.lax.dynamic_update_slice(buf, col[:, :, None], (0, 0, p))

    @functools.partial(jax.jit, donate_argnums=0)
    def v_nibble(buf, col, p):
        byte = jax.lax.dynamic_slice(buf, (0, 0, p // 2), (bh, d, 1))[..., 0]
        sh = (4 * (p % 2)).astype(jnp.uint8)
        nib = (col.astype(jnp.uint8) & 0xF) << sh
        new = (byte & ~(jnp.uint8(0xF) << sh)) | nib
        return jax.lax.dynamic_update_slice(buf, new[:, :, None], (0, 0, p // 2))

    @functools.partial(jax.jit, donate_argnums=0)
    def full_pass(buf, col, p):
        return buf ^ jnp.uint8(1)

    rows = {}
    kbuf = jnp.zeros((bh, t, d), jnp.int4)
    row = jnp.ones((bh, d), jnp.int4)
    rows["k row -> s4 [BH,T,D]"] = (_time(k_row, kbuf, row, pos), k_row.lower(kbuf, row, pos).compile().as_text())
    del kbuf
    vbuf = jnp.zeros((bh, d, t), jnp.int4)
    col = jnp.ones((bh, d), jnp.int4)
    rows["v col -> s4 [BH,D,T] (odd t)"] = (_time(v_col, vbuf, col, pos), v_col.lower(vbuf, col, pos).compile().as_text())
    del vbuf
    ubuf = jnp.zeros((bh, d, t // 2), jnp.uint8)
    colu = jnp.ones((bh, d), jnp.uint8)
    rows["v nibble RMW -> u8 [BH,D,T/2]"] = (_time(v_nibble, ubuf, colu, pos),
                                             v_nibble.lower(ubuf, colu, pos).compile().as_text())
    ubuf = jnp.zeros((bh, d, t // 2), jnp.uint8)
    rows["full pass u8 (reference)"] = (_time(full_pass, ubuf, colu, pos), "")
    # ragged appends: a vmapped DUS with per-sequence positions lowers to a scatter
    @functools.partial(jax.jit, donate_argnums=0)
    def v_col_ragged(buf, col, p):
        ps = p + jnp.arange(bh, dtype=jnp.int32) % 3
        return jax.vmap(lambda b, c, q: jax.lax.dynamic_update_slice(b, c[:, None], (0, q)))(buf, col, ps)

    vbuf = jnp.zeros((bh, d, t), jnp.int4)
    rows["v col ragged (scatter) -> s4"] = (_time(v_col_ragged, vbuf, col, pos),
                                            v_col_ragged.lower(vbuf, col, pos).compile().as_text())
    del vbuf
    if jax.devices()[0].platform == "gpu":
        _kernel_operand_probe(bh, t, d, rows)
    print(f"{jax.devices()[0]} JAX {jax.__version__}, BH={bh} T={t} D={d} "
          f"(buffer {bh * t * d // 2 / 1e6:.0f} MB)")
    for name, (us, hlo) in rows.items():
        conv = "s8[" in hlo and "convert" in hlo
        print(f"  {name:34s} {us:9.1f} us   whole-buffer s8 conversion in HLO: {conv}")


def _kernel_operand_probe(bh, t, d, rows):
    """The Mosaic GPU kernel fed int4 operands directly vs uint8 bytes bitcast to int4 inside the jit (is the
    u8 -> s4 bitcast free, or a pass over the codes?)."""
    import sys, os
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from kvquant_jax.abi.regions import KVFormat
    from pallas_kernels.decode_attention_mgpu import MgpuOperands, decode_attention_mgpu_prepared

    b, hkv, g = bh // 8, 8, 4
    kf = KVFormat("int4", scale="token", zero="symmetric")
    key = jax.random.PRNGKey(0)
    k8 = jax.random.randint(key, (bh, t, d // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    v8 = jax.random.randint(jax.random.fold_in(key, 1), (bh, d, t // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    sc = jnp.full((bh, t), 0.01, jnp.float32)
    q = jax.random.normal(key, (b, hkv * g, d), jnp.bfloat16)
    st, en = jnp.zeros((b,), jnp.int32), jnp.full((b,), t, jnp.int32)

    def as_s4(x):
        return jax.lax.bitcast_convert_type(x, jnp.int4).reshape(x.shape[:-1] + (x.shape[-1] * 2,))

    def call(q, k, v):
        ops = MgpuOperands(k=k, v=v, k_scale=sc, v_scale=sc, k_head_scale=None, v_head_scale=None, start=st,
                           end=en, kf=kf, vf=kf, num_kv_heads=hkv)
        return decode_attention_mgpu_prepared(q, ops)

    k4, v4 = jax.jit(as_s4)(k8), jax.jit(as_s4)(v8)
    direct = jax.jit(call)
    via_u8 = jax.jit(lambda q, k, v: call(q, as_s4(k), as_s4(v)))
    for name, f, args in (("mgpu int4 operands", direct, (q, k4, v4)), ("mgpu u8 -> s4 bitcast", via_u8, (q, k8, v8))):
        f(*args).block_until_ready()
        t0 = time.perf_counter()
        for _ in range(20):
            out = f(*args)
        out.block_until_ready()
        us = (time.perf_counter() - t0) / 20 * 1e6
        hlo = f.lower(*args).compile().as_text()
        rows[name] = (us, hlo)
        print(name, "fusions:", hlo.count(" fusion("), "bitcast-convert:", hlo.count("bitcast-convert"))


if __name__ == "__main__":
    main()
