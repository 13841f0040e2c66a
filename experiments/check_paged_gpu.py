"""The paged decode kernel compiled on the GPU (not interpreted) against the float64 oracle and the contiguous kernel.

Issue M item 4 on the device: CI checks the paged kernel only interpreted (``tests/kernels/
test_paged_decode_attention.py``); this builds the same scattered, shared, released-and-reused page pools for every
format the paged kernel reads in place, runs ``paged_decode_attention`` compiled (Pallas Triton on a GPU), and
reports max|Δ| / max|ref| against the float64 oracle of the contiguous cache of the same history, for the compiled
default precision ("bf16x2": q rounded to bf16, p split hi + lo) and for ``precision="f32"``.

    python experiments/check_paged_gpu.py --out /tmp/check_paged.json      # D 128, pages 16 and 64; exit 1 on a failure
    python experiments/check_paged_gpu.py --head-dim 16 --page 8 16        # the CI test's shapes (2026-12-01 run)
    python experiments/check_paged_gpu.py --page 64 --formats engine         # the engine's groups (KIVI G 32, ...)

``--formats``: names of the CI test's ``SPECS`` (comma separated), ``all`` (default) or ``engine``: the schemes
with the group sizes the engine benchmark serves (KIVI key / value groups and residual of 32 rows, INT4 head_dim
groups of 32, the prefix-KIVI body likewise), which the CI test's 4-row groups cannot show: the compiled MMA rule
refuses 4-row key groups, so those rows only exercise the fallback.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "kernels"))
sys.path.insert(0, str(ROOT / "tests" / "cache"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import test_paged_decode_attention as T  # noqa: E402  (the CI test's builders: one definition of the case)
from kvquant_jax.attention import paged as paged_attn  # noqa: E402
from kvquant_jax.cache.interface import layer_state  # noqa: E402
from pallas_kernels import paged_decode_attention as paged_kernel  # noqa: E402

#: the engine benchmark's group sizes (``--formats engine``; pages must be a multiple of 32 rows)
_KIVI32 = {"name": "kivi2", "group_size": 32, "v_group_size": 32, "residual": 32}
ENGINE_SPECS = {
    "kivi2_g32": _KIVI32, "kivi4_g32": dict(_KIVI32, name="kivi4"), "int4_g32": "int4:group_size=32",
    "prefix_kivi_g32": {"name": "prefix", "prefix_len": 2, "body": _KIVI32},
}

#: bound for a bf16 query / bf16x2 p against the float64 oracle (the contiguous kernel's compiled bound)
BOUND = {"bf16x2": 5e-3, "f32": 1e-3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run (the Triton interpreter)")
    ap.add_argument("--page", type=int, nargs="+", default=[16, 64], help="rows per page (the CI test uses 8)")
    ap.add_argument("--head-dim", type=int, default=128, help="head_dim (the CI test uses 16)")
    ap.add_argument("--formats", default="all", help="'all', 'engine', or SPECS names (comma separated)")
    args = ap.parse_args(argv)
    if args.formats == "engine":
        T.SPECS.update(ENGINE_SPECS)
        args.formats = ",".join(ENGINE_SPECS)
    names = sorted(T.SPECS) if args.formats == "all" else args.formats.split(",")
    unknown = [n for n in names if n not in T.SPECS]
    if unknown:
        ap.error(f"unknown formats {unknown}; known: {sorted(T.SPECS)} or 'engine'")
    args.names = names
    rows, failed = [], []
    T.D = args.head_dim                                 # the builders read the module's sizes
    for page in args.page:
        T.PAGE = page
        r, f = check_all(args)
        rows += [dict(x, page=page) for x in r]
        failed += [f"page {page}: {x}" for x in f]
    out = {"device": str(jax.devices()[0]), "jax": jax.__version__, "bounds": BOUND, "rows": rows,
           "failed": failed}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    print("FAILED: " + ", ".join(failed) if failed else "all paged formats within bounds", flush=True)
    return 1 if failed else 0


def check_all(args):
    rows, failed = [], []
    for name in args.names:
        if name in T.NOT_IN_PLACE:
            continue
        cache, ref, rng = T._build(name, seed=sorted(T.SPECS).index(name))
        q = jnp.asarray(rng.normal(0, 1, (T.B, T.HQ, T.D)).astype(np.float32)).astype(jnp.bfloat16)
        kn, vn = (jnp.asarray(rng.normal(0, 1, (T.B, T.H, T.D)).astype(np.float32)) for _ in range(2))
        scheme, state = layer_state(ref, 0)
        want = T._oracle(np.asarray(q, np.float32), scheme, state, ref.lengths, kn, vn)
        reg, _, _, _ = paged_attn.paged_regions(cache, 0)
        # a region the compiled kernel refuses is served by the contiguous fallback (what the engine would do)
        row = {"format": name, "refused": paged_kernel.paged_unsupported(reg, T.D, compiled_gpu=not args.interpret)}
        for precision in ("bf16x2", "f32"):
            t0 = time.perf_counter()
            try:
                got = jax.jit(lambda c, q, kn, vn, p=precision: paged_attn.decode_attention(
                    q, c, 0, kn, vn, impl="kernel", backend="gpu", interpret=args.interpret, precision=p,
                    out_dtype=jnp.float32))(cache, q, kn, vn)
                rel = T._rel(got, want)
                row[precision] = rel
                ok = np.isfinite(rel) and rel < BOUND[precision]
            except Exception as e:                          # noqa: BLE001 -- report every format, then fail
                row[precision] = f"{type(e).__name__}: {str(e)[:400]}"
                ok = False
            row[f"{precision}_s"] = round(time.perf_counter() - t0, 2)
            if not ok:
                failed.append(f"{name}/{precision}")
        rows.append(row)
        print(json.dumps(dict(row, page=T.PAGE)), flush=True)
    return rows, failed


if __name__ == "__main__":
    sys.exit(main())
