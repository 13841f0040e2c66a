"""Mosaic GPU per-token INT2 / INT4 decode attention (issue J): float64-oracle parity + timing vs cuDNN and Triton.

    python experiments/check_mgpu_planar.py --out $OUT/planar                  # (a) parity, (b) timing at 4K, 32K
    python experiments/check_mgpu_planar.py --check-only
    python experiments/check_mgpu_planar.py --skip-check --T 32768 --formats int2,qserve --variants "stages 3"

The kernels: ``pallas_kernels/decode_attention_mgpu_planar.py`` (the token-planar KIVI kernel with per-token keys;
impl ``mgpu``) and ``pallas_kernels/decode_attention_mgpu_planar_s8.py`` (the same operands on s8 tensor cores; impl
``mgpu_s8``, parity rows ``precision="s8"`` bound 5e-5 where it reads the case: V groups 0 or multiples of 64; its
``pv_limbs=2`` variant bound 5e-4).  ``--check-only --variants NAMES`` runs those s8 variants' parity rows too (GPU;
``--variants-only``: only those and the default config, not the limb paths / PV limbs / barrier modes).
``--impls`` picks among ``triton,mgpu,mgpu_s8`` (default all three; the bf16 kernel's parity rows need ``mgpu``).
(a) Small ragged cases (B=3, Hkv=2, T=512, poisoned dead rows: NaN qparams, the current token in the same softmax)
    against the float64 NumPy oracle: INT2 / INT4, zero conventions symmetric / offset (QServe) / min, V groups
    16 / 32 / 64 / D, D 64 / 128 / 256, GQA 1 / 3 / 4 / 8, bf16 and float32 queries, both precisions.  Bounds:
    ``bf16x2`` 5e-5 relative (max-abs / max-abs), ``bf16`` 4e-3.
(b) B=8, Hq=32, Hkv=8, D=128 (or --B/--hq/--hkv/--d) at each --T: cuDNN bf16, the Triton kernel on the layout-v1
    region and the Mosaic kernel on the prepared token-planar operands (converted outside the timed program, as a
    cache would store them; fp16 qparams) in ONE process with ``bench_decode_attention.py``'s rotating input sets
    and clock.  Formats: ``int2`` (symmetric), ``qserve`` (int4, floating offset), ``int4`` (symmetric: against
    v1's int4 in ``check_mgpu_decode.py``).  Bytes = the prepared arrays + the query; ``x`` = speed vs cuDNN.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import check_mgpu_kivi as ck  # noqa: E402
from kvquant_jax.abi.regions import KVFormat  # noqa: E402
from kvquant_jax.attention.synthetic import PRESETS  # noqa: E402
from pallas_kernels import decode_attention_mgpu_kivi as mk  # noqa: E402
from pallas_kernels import decode_attention_mgpu_planar as mp  # noqa: E402
from pallas_kernels import decode_attention_mgpu_planar_s8 as s8  # noqa: E402

#: (bits, K zero, V zero, V group, D, GQA group) of the parity cases
PARITY_CASES = [(2, "symmetric", "symmetric", 0, 128, 4), (4, "offset", "offset", 0, 128, 4),
                (2, "min", "offset", 16, 64, 3), (4, "symmetric", "min", 64, 256, 8),
                (2, "offset", "symmetric", 32, 64, 1), (4, "symmetric", "symmetric", 0, 128, 4)]
BOUND = ck.BOUND
BOUND_S8 = 5e-5                   # the s8 kernel: 21-bit query and p*sv limbs (module docstring)
BOUND_S8_PV2 = 5e-4               # its pv_limbs=2 variant: 14-bit p*sv, >= 12 bits per plane (CPU twin <= 2.2e-4)
TIMED = {"int2": PRESETS["int2"], "qserve": PRESETS["qserve"], "int4": PRESETS["int4"]}


def variant_configs(dflt: mk.KiviMgpuConfig, s0: int) -> dict[str, mk.KiviMgpuConfig]:
    """--variants: name -> config (changes from ``dflt``; ``s0`` = the default's splits)."""
    rep = dataclasses.replace
    return {"stages 3": rep(dflt, max_concurrent_steps=3), "stages 4": rep(dflt, max_concurrent_steps=4),
            "splits x2": rep(dflt, num_splits=2 * s0), "splits /2": rep(dflt, num_splits=max(1, s0 // 2)),
            "prec bf16": rep(dflt, precision="bf16"),
            **{f"inflight {k}": rep(dflt, wgmma_inflight=k) for k in (0, 1, 2)},
            "qk batch 1": rep(dflt, qk_plane_batch=1),
            **{f"barriers {b}": rep(dflt, barriers=b) for b in mk.BARRIER_MODES if b != dflt.barriers}}


#: the s8 kernel's load variants: (name, qparams_early, v_early), set explicitly (the default depends on the format)
LOAD_VARIANTS = (("qparams late", False, True), ("v late", True, False), ("late loads", False, False),
                 ("early loads", True, True))


def s8_variant_configs(dflt: s8.PlanarS8Config, s0: int) -> dict[str, s8.PlanarS8Config]:
    """--variants of the s8 kernel: the names it shares with :func:`variant_configs`, and ``limbs <path>`` for
    each other :data:`~pallas_kernels.decode_attention_mgpu_planar_s8.LIMB_PATHS` entry, ``pv limbs <n>`` for each
    other ``PV_LIMBS`` entry, ``barriers <b>`` for each other ``BARRIERS`` entry, and the two together.  The
    default has the unmasked full blocks, (where g <= 4) packed planes, 2 blocks per step and the loads where
    ``auto_early_loads`` puts them (late for INT2 at 2 blocks, early otherwise): ``qparams late`` / ``v late`` (the
    other one early), ``late loads`` and ``early loads`` (both) set them whatever the format, ``masked full`` and
    ``unpacked`` turn one off, ``unpacked + late loads + masked full`` is the default before 2026-12-07 evening,
    ``pack planes`` forces packing and ``merged pv`` (alone, or with ``step blocks 1 +``, that with ``+ late
    loads`` and / or ``+ splits x2``: fewer registers, and the CTAs for 3 per SM should the registers allow them)
    one PV accumulator for both plane parities (both refused, and skipped by name, with more than 4 query heads per
    KV head);
    ``step blocks <n>`` (with ``+ stages 3``, ``+ unpacked``, ``+ late loads``, ``+ early loads``, ``+ qparams
    late``, ``+ v late``) takes ``n`` token blocks per pipeline step (its parity rows run with one split where the
    case's blocks per split are too few)."""
    rep = dataclasses.replace
    return {"stages 3": rep(dflt, max_concurrent_steps=3), "stages 4": rep(dflt, max_concurrent_steps=4),
            "splits x2": rep(dflt, num_splits=2 * s0), "splits /2": rep(dflt, num_splits=max(1, s0 // 2)),
            **{f"limbs {lp}": rep(dflt, limb_path=lp) for lp in s8.LIMB_PATHS if lp != dflt.limb_path},
            **{f"pv limbs {n}": rep(dflt, pv_limbs=n) for n in s8.PV_LIMBS if n != dflt.pv_limbs},
            **{f"barriers {b}": rep(dflt, barriers=b) for b in s8.BARRIERS if b != dflt.barriers},
            **{f"pv limbs {n} + barriers {b}": rep(dflt, pv_limbs=n, barriers=b)
               for n in s8.PV_LIMBS if n != dflt.pv_limbs for b in s8.BARRIERS if b != dflt.barriers},
            **{nm: rep(dflt, qparams_early=a, v_early=v) for nm, a, v in LOAD_VARIANTS},
            "masked full": rep(dflt, unmasked_full_blocks=False),
            "unpacked": rep(dflt, pack_planes=False),
            "pack planes": rep(dflt, pack_planes=True),
            "merged pv": rep(dflt, merged_pv=True),
            **{f"step blocks 1 + merged pv{late}{sx}": rep(dflt, step_blocks=1, merged_pv=True,
                                                           **(dict(qparams_early=False, v_early=False) if late else {}),
                                                           **(dict(num_splits=2 * s0) if sx else {}))
               for late in ("", " + late loads") for sx in ("", " + splits x2")},
            "unpacked + late loads + masked full": rep(dflt, pack_planes=False, qparams_early=False, v_early=False,
                                                      unmasked_full_blocks=False),
            **{f"step blocks {n}": rep(dflt, step_blocks=n) for n in (1, 2, 4)},
            **{f"step blocks {n} + stages 3": rep(dflt, step_blocks=n, max_concurrent_steps=3) for n in (2,)},
            "step blocks 2 + unpacked": rep(dflt, step_blocks=2, pack_planes=False),
            **{f"step blocks 2 + {nm}": rep(dflt, step_blocks=2, qparams_early=a, v_early=v)
               for nm, a, v in LOAD_VARIANTS}}


#: every --variants name (the bf16 kernel's, then the s8 kernel's own: an impl times the names it has)
VARIANTS = tuple(dict.fromkeys([*variant_configs(mk.KiviMgpuConfig(), 1), *s8_variant_configs(s8.PlanarS8Config(), 1)]))
#: the s8 kernel as a timed impl (``--impls ...,mgpu_s8``)
S8_IMPL = ck.MosaicImpl(s8.decode_attention_mgpu_planar_s8_prepared, s8.PlanarS8Config(),
                        lambda ops, g, cfg: s8._spec(ops, g, cfg).ns, s8_variant_configs)


def parity(args, results) -> bool:
    rng = np.random.default_rng(0)
    interp = jax.devices()[0].platform != "gpu"      # CPU: the plain-JAX twin
    # the s8 kernel under every limb path and barrier mode on a GPU (the twin is the same for all: the default
    # alone on CPU), and with 2 PV limbs
    s8_paths = (s8.PlanarS8Config().limb_path,) if interp else s8.LIMB_PATHS
    s8_entry = s8.decode_attention_mgpu_planar_s8_prepared
    ok_all = True
    for ci, (bits, kz, vz, vg, d, g) in enumerate(PARITY_CASES):
        if args.cases is not None and ci not in args.cases:
            continue
        kf, vf = KVFormat(f"int{bits}", "token", kz), KVFormat(f"int{bits}", "token", vz, vg)
        reg, kn, vn, queries = ck.parity_inputs(rng, kf, vf, d, g)
        ops = mp.prepare_token_planar_region(reg) if "mgpu_s8" in args.impls else None
        s8_reads = ops is not None and s8.s8_unsupported(ops, g) is None
        for qname, q in queries:
            ref = mp.decode_attention_mgpu_planar_reference_f64(q, reg, k_new=kn, v_new=vn)
            for prec in ("bf16x2", "bf16") if "mgpu" in args.impls else ():
                cfg = mk.KiviMgpuConfig(precision=prec, num_splits=2)
                row = dict(kind="parity", case=ci, bits=bits, k_zero=kz, v_zero=vz, v_group=vg, d=d, g=g, q=qname,
                           precision=prec)
                serve = lambda q=q, cfg=cfg: (jax.jit(lambda q, r, kn, vn: mp.decode_attention_mgpu_planar(  # noqa: E731
                    q, r, k_new=kn, v_new=vn, config=cfg, out_dtype=jnp.float32, interpret=interp))(
                    q, reg, kn, vn), {}, True)
                ok_all &= ck.parity_row(args, results, row, serve, ref, BOUND[prec],
                                        f"case {ci} int{bits} K {kz} V {vz} Gv={vg} D={d} g={g} q={qname} {prec}")
            s8_cfgs = [s8.PlanarS8Config(num_splits=2, limb_path=lp) for lp in s8_paths]
            dflt = s8.PlanarS8Config()
            s8_cfgs += [s8.PlanarS8Config(num_splits=2, pv_limbs=n, barriers=b) for n in s8.PV_LIMBS
                        for b in ((dflt.barriers,) if interp else s8.BARRIERS)
                        if (n, b) != (dflt.pv_limbs, dflt.barriers)]
            # (--variants NAMES: those s8 variants too, on a GPU, each by its name; on their own beside the default
            #  with --variants-only)
            named = {c: "" for c in (s8_cfgs[:1] if args.variants_only else s8_cfgs)}
            if isinstance(getattr(args, "variants", None), list) and not interp:
                every = s8_variant_configs(s8.PlanarS8Config(num_splits=2), 2)
                named.update({every[v]: v for v in args.variants if v in every and every[v] not in named})
            for cfg, vname in named.items() if s8_reads else ():
                if (ops.rows // ops.block_t // (cfg.num_splits or 1)) % (cfg.step_blocks or 1):
                    cfg = dataclasses.replace(cfg, num_splits=1)  # (more step blocks than a split has: one split)
                try:
                    s8._spec(ops, g, cfg)
                except NotImplementedError as err:     # (a variant this case's shape refuses: pack planes, g > 4)
                    print(f"case {ci} s8 [{vname}]: skipped, {err}")
                    continue
                lp, bound = cfg.limb_path, BOUND_S8 if cfg.pv_limbs == 3 else BOUND_S8_PV2
                row = dict(kind="parity", case=ci, bits=bits, k_zero=kz, v_zero=vz, v_group=vg, d=d, g=g, q=qname,
                           precision="s8", limb_path=lp, pv_limbs=cfg.pv_limbs, barriers=cfg.barriers,
                           **({"variant": vname} if vname else {}))
                serve = lambda q=q, ops=ops, cfg=cfg: (jax.jit(lambda q, o, kn, vn: s8_entry(  # noqa: E731
                    q, o, k_new=kn, v_new=vn, config=cfg, out_dtype=jnp.float32, interpret=interp))(
                    q, ops, kn, vn), {}, True)
                ok_all &= ck.parity_row(args, results, row, serve, ref, bound,
                                        f"case {ci} int{bits} K {kz} V {vz} Gv={vg} D={d} g={g} q={qname} s8 {lp} "
                                        f"pv{cfg.pv_limbs} {cfg.barriers}" + (f" [{vname}]" if vname else ""))
    return ok_all


def timing(args, results, t, rep: int):
    """``int2`` / ``qserve`` / ``int4`` (:data:`TIMED`) at one T: ``check_mgpu_kivi.timing_formats`` with the
    token-planar preparation and entry."""
    ck.timing_formats(args, results, t, rep, TIMED.__getitem__, mp.prepare_token_planar_region,
                      mp.decode_attention_mgpu_planar_prepared, variant_configs, extra={"mgpu_s8": S8_IMPL})


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--formats" or a.startswith("--formats=") for a in argv):
        argv += ["--formats", "int2,qserve,int4"]
    kivi_variants, ck.VARIANTS = ck.VARIANTS, VARIANTS    # parse_args checks --variants against this script's list
    try:
        args = ck.parse_args(argv, __doc__, "triton,mgpu,mgpu_s8", variants_only=True)
    finally:
        ck.VARIANTS = kivi_variants
    unknown = sorted(set(args.formats) - set(TIMED))
    if unknown:
        raise SystemExit(f"unknown formats {unknown}; known: {', '.join(TIMED)}")
    ok, checked_only = ck.run(args, parity, timing)
    return (0 if ok else 1) if checked_only else 0


if __name__ == "__main__":
    sys.exit(main())
