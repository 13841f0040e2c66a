"""Why the Mosaic KIVI kernel's error against the reference grows with T on random data (issue J, CPU only).

    python experiments/probe_kivi_cancellation.py                      # T = 512 ... 32768, table on stdout
    python experiments/probe_kivi_cancellation.py --T 512,131072 --json out.json

The kernel (:mod:`pallas_kernels.decode_attention_mgpu_kivi`) forms the PV output of a KIVI V group as two float32
sums, ``sum_t p_t u_t sv_t`` (the wgmma over the codes) and ``z = sum_t p_t mv_t`` (beside the softmax sum), and
adds them at the end; the Triton kernel and the reference dequantize ``v = u sv + mv`` per element first.  On
random normal V the two sums are O(1) with opposite signs (codes ``u >= 0``, mins ``mv < 0``) while the output, an
average of ~T independent values, shrinks like 1/sqrt(T): float32 rounding of the large sums becomes a growing
fraction of the output.

This probe computes, with NumPy on one (sequence, head) of D = 128, KIVI-2 V groups of 32 channels and random
logits, the output five ways against the float64 dequantize-first sum:

* ``split f64``: the kernel's two-sum algebra in float64 (checks that the algebra itself is exact);
* ``split f32``: the two sums in float32 with exact ``p * sv`` (rounding of the accumulation only);
* ``split bf16x2``: as the kernel: ``p * sv`` rounded to a bf16 hi + lo pair, float32 sums;
* ``centred bf16x2``: the same with the codes re-centred (``u - 2^(bits-1)``, ``mv + 2^(bits-1) sv``), what the
  kernel's top plane already stores;
* ``dequant f32``: dequantize first, float32 sum (the Triton kernel's order).

Errors are max-abs over the head's D outputs divided by the reference's max-abs (the check scripts' metric), and
also divided by max |v| (error on the scale of the values).  Summation order differs from the kernel's (NumPy's
pairwise sums vs the kernel's per-block wgmma + running rescale), so the figures are the mechanism, not the device
numbers.
"""
from __future__ import annotations

import argparse
import json
import sys

import ml_dtypes
import numpy as np

_BF16 = ml_dtypes.bfloat16


def _bf16(x: np.ndarray) -> np.ndarray:
    return x.astype(_BF16).astype(np.float32)


def kivi_v(rng: np.random.Generator, t: int, d: int, group: int, bits: int):
    """Random V ``[t, d]`` quantized KIVI-style per token in ``group``-channel groups: codes ``u [t, d/group,
    group]``, scale ``sv`` and min ``mv [t, d/group]`` (float64), and the dequantized ``v [t, d]``."""
    v = rng.standard_normal((t, d)).reshape(t, d // group, group)
    mv = v.min(-1)
    sv = (v.max(-1) - mv) / (2 ** bits - 1)
    u = np.clip(np.round((v - mv[..., None]) / sv[..., None]), 0, 2 ** bits - 1)
    return u, sv, mv, (u * sv[..., None] + mv[..., None]).reshape(t, d)


def outputs(u, sv, mv, vq, p, bits: int) -> dict[str, np.ndarray]:
    """The normalized output ``[d]`` of each summation (module docstring); ``p [t]`` float64 softmax weights."""
    t, c, g = u.shape
    f32 = np.float32
    pl = p.sum()

    def split(pv, codes, mins, dtype):
        acc = np.einsum("tc,tcg->cg", pv.astype(dtype), codes.astype(dtype)).reshape(c * g)
        z = (p[:, None] * mins).astype(dtype).sum(0)
        return (acc + np.repeat(z, g)).astype(np.float64) / pl

    pv = p[:, None] * sv
    hi = _bf16(pv.astype(f32))
    pv2 = hi + _bf16(pv.astype(f32) - hi)
    half = 2.0 ** (bits - 1)
    return {
        "split f64": split(pv, u, mv, np.float64),
        "split f32": split(pv, u, mv, f32),
        "split bf16x2": split(pv2, u, mv, f32),
        "centred bf16x2": split(pv2, u - half, mv + half * sv, f32),
        "dequant f32": (p[:, None].astype(f32) * vq.astype(f32)).sum(0).astype(np.float64) / pl,
    }


def probe(ts, d: int = 128, group: int = 32, bits: int = 2, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for t in ts:
        u, sv, mv, vq = kivi_v(rng, t, d, group, bits)
        s = rng.standard_normal(t)
        p = np.exp(s - s.max())
        ref = (p[:, None] * vq).sum(0) / p.sum()
        for name, o in outputs(u, sv, mv, vq, p, bits).items():
            err = np.abs(o - ref).max()
            rows.append(dict(T=t, sum=name, rel_err=float(err / np.abs(ref).max()),
                             err_over_max_v=float(err / np.abs(vq).max()), ref_max_abs=float(np.abs(ref).max())))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", default="512,4096,32768")
    ap.add_argument("--bits", type=int, default=2, choices=(2, 4))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    rows = probe([int(x) for x in a.T.split(",") if x], bits=a.bits, seed=a.seed)
    print(f"{'T':>7} {'sum':16} {'err/max|o|':>11} {'err/max|v|':>11} {'max|o|':>8}")
    for r in rows:
        print(f"{r['T']:7d} {r['sum']:16} {r['rel_err']:11.2e} {r['err_over_max_v']:11.2e} {r['ref_max_abs']:8.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
