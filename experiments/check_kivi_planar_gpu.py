"""The token-planar KIVI cache (``kivi2_planar`` / ``kivi4_planar``) served through ``attention.dispatch`` on a GPU
(issue J): float64-oracle parity of the served path, and its time against the layout-1 KIVI cache and cuDNN.

    python experiments/check_kivi_planar_gpu.py --out $OUT/planar            # (a) parity, (b) timing at 4K, 32K
    python experiments/check_kivi_planar_gpu.py --check-only
    python experiments/check_kivi_planar_gpu.py --skip-check --T 32768 --repeat 3

(a) Caches filled by the schemes' own appends (a ragged prefill, then one decode row; B=3, Hkv=2, capacity two
    blocks; rules "kivi" / "synchronized", R 0 / 32 / 64 / 128; K groups 16 / 32 / 64, V groups 16 / 32 / 128 / D;
    D 64 / 128 / 256; GQA 1 / 3 / 4 / 8), bf16 and float32 queries, the current token in the same softmax.  The
    planar layer goes through ``dispatch.decode_attention(impl="auto")`` under jit: the row fails unless the served
    path (``dispatch.SERVED``) is the fused Mosaic kernel.  Oracle: the float64 NumPy reference
    (``abi.reference.decode_attention_reference``) over the regions of a *layout-1* KIVI cache given the same
    appends (the two layouts hold the same codes: this also checks that).  Bound 5e-5 relative (max-abs / max-abs;
    the kernel's default ``bf16x2`` precision).
(b) B=8, Hq=32, Hkv=8, D=128, capacity = length = T, K/V groups 32, R = 128 ("kivi" rule): cuDNN bf16; per
    format, the layout-1 cache through dispatch (the Pallas Triton region kernel + the ring tail), the planar cache
    through dispatch (the Mosaic kernel reading the cache in place + the ring tail + the logit-offset einsum), and
    the bare Mosaic kernel on the same cache's operands (the quantized rows only, no tail: its error is against the
    reference over those rows) -- ``--impls`` triton / mosaic / bare; one process, the device clock of
    ``bench_decode_attention.time_program``, rotating input sets.  Bytes = every array of the layer state + the
    query; ``x`` = speed vs cuDNN.
"""
from __future__ import annotations

import functools
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode_attention import baseline_fns, n_sets_for, rel_err, time_program  # noqa: E402
from check_mgpu_decode import cudnn_sets, timing_query  # noqa: E402
from check_mgpu_kivi import LOG, parity_row, parse_args, run, timing_row  # noqa: E402
from kvquant_jax.abi.reference import decode_attention_jnp, decode_attention_reference  # noqa: E402
from kvquant_jax.attention import dispatch  # noqa: E402
from kvquant_jax.cache.kivi import KIVIScheme  # noqa: E402
from kvquant_jax.cache.kivi_planar import KIVIPlanarScheme  # noqa: E402
from pallas_kernels import decode_attention_mgpu_kivi as mk  # noqa: E402

#: (bits, K group, V group, D, GQA group, residual, rule) of the parity cases
PARITY_CASES = [(2, 32, 32, 128, 4, 128, "kivi"), (4, 32, 32, 128, 4, 128, "kivi"),
                (2, 16, 0, 64, 3, 32, "synchronized"), (2, 64, 64, 256, 8, 0, "kivi"),
                (4, 64, 16, 64, 1, 64, "synchronized"), (2, 32, 128, 128, 4, 128, "kivi")]
BOUND = 5e-5
KERNEL = "decode_attention_kivi_planar"

__all__ = ["PARITY_CASES", "schemes_for", "filled", "parity", "timing", "main"]


def schemes_for(bits, kg, vg, r, rule):
    """The layout-1 KIVI scheme and its token-planar twin (same quantizer, frontiers and rings)."""
    kw = dict(k_bits=bits, v_bits=bits, group_size=kg, v_group_size=vg, residual=r, residual_rule=rule)
    return KIVIScheme(**kw), KIVIPlanarScheme(**kw)


def filled(scheme, batch, hkv, capacity, d, appends):
    """A layer of ``scheme`` after the appends ``[(k, v, num_new)]`` (``k, v [B, T, Hkv, D]``) from empty:
    ``(state, lengths)``; each append jitted."""
    state = scheme.init_layer(batch, capacity, hkv, d)
    lengths = jnp.zeros((batch,), jnp.int32)
    app = jax.jit(scheme.append_layer)
    for k, v, n in appends:
        state = app(state, lengths, k, v, n)
        lengths = lengths + n
    return jax.block_until_ready(state), lengths


_row = functools.partial(timing_row, widths=(18, 13, 4))


def parity(args, results) -> bool:
    rng = np.random.default_rng(0)
    ok_all = True
    interp = jax.devices()[0].platform != "gpu"
    impl = "kernel" if interp else "auto"              # CPU: the fused entry's plain-JAX twin
    b, hkv = 3, 2
    for ci, (bits, kg, vg, d, g, r, rule) in enumerate(PARITY_CASES):
        if args.cases is not None and ci not in args.cases:
            continue
        lay1, planar = schemes_for(bits, kg, vg, r, rule)
        cap = 2 * planar.block_t
        t0 = cap - 1
        k0 = rng.standard_normal((b, t0, hkv, d)).astype(np.float32)
        v0 = rng.standard_normal((b, t0, hkv, d)).astype(np.float32)
        k1 = rng.standard_normal((b, 1, hkv, d)).astype(np.float32)
        v1 = rng.standard_normal((b, 1, hkv, d)).astype(np.float32)
        n0 = np.array([t0, cap // 2 + 5, 131], np.int32)
        appends = [(jnp.asarray(k0), jnp.asarray(v0), jnp.asarray(n0)),
                   (jnp.asarray(k1), jnp.asarray(v1), jnp.asarray(np.array([0, 1, 1], np.int32)))]
        ref_state, lengths = filled(lay1, b, hkv, cap, d, appends)
        st, lengths_p = filled(planar, b, hkv, cap, d, appends)
        regions, _ = lay1.decode_regions(ref_state, lengths)
        kn = jnp.asarray(rng.standard_normal((b, hkv, d)).astype(np.float32))
        vn = jnp.asarray(rng.standard_normal((b, hkv, d)).astype(np.float32))
        q32 = jnp.asarray(rng.standard_normal((b, hkv * g, d)).astype(np.float32))
        for qname, q in (("f32", q32), ("bf16", q32.astype(jnp.bfloat16))):
            ref = decode_attention_reference(q, regions, k_new=kn, v_new=vn)
            row = dict(kind="parity", case=ci, bits=bits, k_group=kg, v_group=vg, d=d, g=g, residual=r, rule=rule,
                       q=qname, lengths=np.asarray(lengths).tolist())

            def serve(q=q):
                dispatch.SERVED.clear()
                out = jax.jit(lambda q, s, ln, kn, vn: dispatch.decode_attention(
                    q, planar, s, ln, kn, vn, impl=impl, interpret=interp or None, out_dtype=jnp.float32))(
                    q, st, lengths_p, kn, vn)
                served = sorted({k[0] for k in dispatch.SERVED})
                return out, {"served": served}, served == [KERNEL]

            ok_all &= parity_row(args, results, row, serve, ref, BOUND,
                                 f"case {ci} bits={bits} G={kg} Gv={vg} D={d} g={g} R={r} {rule} q={qname}")
    return ok_all


#: the ``--impls`` name of each timed route
IMPL_OPTION = {"dispatch_triton": "triton", "dispatch_mosaic": "mosaic", "mosaic_bare": "bare"}


def _nbytes(tree) -> int:
    return int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree)))


def timing(args, results, t, rep: int):
    b, hq, hkv, d = args.B, args.hq, args.hkv, args.d
    key, q = timing_query(t, b, hq, d)
    tag = f"r{rep}"
    base = {}
    bf16_bytes = 2 * b * hkv * t * d * 2
    kv_sets = cudnn_sets(key, b, hkv, t, d, n_sets_for(bf16_bytes))
    try:
        med, lo, hi, _ = time_program(baseline_fns()["cudnn"], q, kv_sets, args.reps)
        base["cudnn"] = med
        _row(results, args, T=t, impl="cudnn", format="bf16", variant=tag, us=med * 1e6, us_min=lo * 1e6,
             us_max=hi * 1e6, bytes=bf16_bytes, tbps=bf16_bytes / med / 1e12, speedup_vs_cudnn=1.0)
    except Exception as e:  # noqa: BLE001
        _row(results, args, T=t, impl="cudnn", format="bf16", error=f"{type(e).__name__}: {e}"[:800])
    full = jnp.full((b,), t, jnp.int32)
    for name in args.formats:
        bits = int(name[len("kivi"):])
        lay1, planar = schemes_for(bits, 32, 32, 128, "kivi")
        # float32 references over the first set, from a layout-1 cache given the same append (the same values):
        # the whole layer, and its quantized rows only (what the bare kernel reads)
        s1 = filled(lay1, b, hkv, t, d, [(*kv_sets[0], full)])[0]
        ref, ref_bare = (np.asarray(jax.jit(lambda q, s, n=n: decode_attention_jnp(
            q, lay1.decode_regions(s, full)[0][:n], out_dtype=jnp.float32))(q, s1)) for n in (2, 1))
        del s1
        built = {}
        for scheme, impl, label in ((lay1, "dispatch_triton", name), (planar, "dispatch_mosaic", f"{name}_planar"),
                                    (planar, "mosaic_bare", f"{name}_planar")):
            if IMPL_OPTION[impl] not in args.impls:
                continue
            try:
                if scheme not in built:
                    built = {scheme: [filled(scheme, b, hkv, t, d, [(k, v, full)])[0] for k, v in kv_sets]}
                sets = built[scheme]
                if impl == "mosaic_bare":
                    fn = lambda q, s, sch=scheme: mk.decode_attention_mgpu_kivi_prepared(  # noqa: E731
                        q, mk.planar_operands(sch.kernel_format, sch.fused_decode_operand(s, full)[1]),
                        out_dtype=jnp.float32, interpret=jax.devices()[0].platform != "gpu")
                else:
                    fn = lambda q, s, sch=scheme: dispatch.decode_attention(  # noqa: E731
                        q, sch, s, full, impl="auto", out_dtype=jnp.float32)
                if args.hlo and impl == "dispatch_mosaic" and rep == 0 and args.out:
                    text = jax.jit(fn).lower(q, sets[0]).compile().as_text()
                    with open(os.path.join(args.out, f"hlo_{label}_T{t}.txt"), "w") as f:
                        f.write(text)
                dispatch.SERVED.clear()
                med, lo, hi, out = time_program(fn, q, sets, args.reps)
                read = _nbytes(sets[0]) + q.size * 2
                _row(results, args, T=t, impl=impl, format=label, variant=tag, us=med * 1e6, us_min=lo * 1e6,
                     us_max=hi * 1e6, bytes=read, tbps=read / med / 1e12,
                     rel_err=rel_err(out, ref_bare if impl == "mosaic_bare" else ref),
                     served=sorted({k[0] for k in dispatch.SERVED}),
                     speedup_vs_cudnn=base.get("cudnn", float("nan")) / med)
                del sets
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                _row(results, args, T=t, impl=impl, format=label, error=f"{type(e).__name__}: {e}"[:1500])
    del kv_sets


def main(argv=None):
    LOG.clear()
    args = parse_args(argv, __doc__, "triton,mosaic,bare", "triton: the layout-1 cache through dispatch; mosaic: "
                      "the planar cache through dispatch; bare: the Mosaic kernel alone on the planar cache's operands",
                      variants=False, hlo=True)
    unknown = sorted(args.impls - set(IMPL_OPTION.values()))
    if unknown:
        raise SystemExit(f"--impls: unknown {unknown}; known: {', '.join(IMPL_OPTION.values())}")
    ok, _ = run(args, parity, timing)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
