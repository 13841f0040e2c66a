"""Nsight Compute counters of the decode kernels at the timed shape of ``check_mgpu_decode.py`` (issue J).

    python3 experiments/ncu_decode.py --out $OUT/ncu                    # driver: every case under ncu, JSON + md
    python3 experiments/ncu_decode.py --T 32768 --formats int4 --impls v1,ws --case-timeout 240
    python3 experiments/ncu_decode.py --T 32768 --formats kivi2,kivi4 --impls mgpu_kivi,triton   # KIVI: Mosaic + Triton
    python3 experiments/ncu_decode.py --parse ncu_v1_int4_T32768.log    # re-parse one saved ncu log (no GPU)
    python3 experiments/ncu_decode.py --child --impl ws --format int8 --T 32768   # what ncu runs, one case
    python3 experiments/ncu_decode.py --child --impl mgpu_kivi --format kivi2 --T 512 --B 2 --interpret  # CPU smoke

Driver: per case (impl x format x T; cuDNN only for bf16, ``mgpu_kivi`` only for kivi2 / kivi4, v1 / ws not for
the formats only the Triton kernel or the KIVI kernels read: the pairs left out are logged and listed under
``skipped`` in the JSON) it runs, with a timeout,

    ncu --clock-control none --target-processes all --kernel-name regex:<pattern> --launch-skip <warmup>
        --launch-count 1 --csv --print-units base --log-file <case>.log --metrics <METRICS>
        python3 experiments/ncu_decode.py --child ...

and parses the CSV (:func:`parse_ncu_csv`, :func:`case_row`) into one row: kernel name, duration, DRAM bytes read
(against the bytes the kernel must read), DRAM throughput % of peak, achieved occupancy, registers / thread,
shared memory / block, shared-memory bank conflicts, local-memory load / store bytes and instructions (register
spills: 0 when nothing spills; ``l1tex__t_bytes_pipe_lsu_mem_local_op_{ld,st}.sum``, else the ``..._sectors_...``
counts x 32), the top warp-stall reasons (warps stalled per issued instruction).  A pattern that matches no kernel
gives a row that says so, with the kernel names ncu saw in a second, unfiltered listing pass
(``--no-list-on-miss``: skip it); a metric this ncu does not know is dropped and the case re-run (once per batch
of refused names; the row names the dropped metrics, the later cases do not ask for them).  ncu's default
``--cache-control all`` flushes the caches before the profiled launch, so DRAM bytes ~ the bytes the kernel reads
from a cold L2.

Child (``--child``): the inputs of ``check_mgpu_decode.py``'s timing at one T, built by ITS functions
(:func:`check_mgpu_decode.timing_query`, ``cudnn_sets``, ``bench.region_sets``, ``prepared_sets``, ...; one input
set: ``--sets``), then ``--warmup`` calls and ``--calls`` calls of the jitted kernel, each ``block_until_ready``.
Impls: ``v1`` (``decode_attention_mgpu``), ``ws`` (``decode_attention_mgpu_ws``), ``triton`` (the Pallas Triton
kernel), ``cudnn`` (bf16 only), ``mgpu_kivi`` (``decode_attention_mgpu_kivi_prepared``, kivi2 / kivi4 only: the
inputs of ``check_mgpu_kivi.py``'s timing -- ``kivi_formats(bits, 32, 32)``, ``bench.region_sets``,
``jax.jit(prepare_kivi_region)`` outside the profiled call; bytes = ``check_mgpu_decode.mgpu_read_bytes``),
``mgpu_planar`` (``decode_attention_mgpu_planar_prepared``, int2 / qserve / int4: ``check_mgpu_planar.py``'s inputs,
``prepare_token_planar_region`` outside the profiled call), ``mgpu_planar_s8`` (the same inputs through
``decode_attention_mgpu_planar_s8_prepared``: s8 tensor cores);
``--config JSON`` overrides fields of the v1 / ws / ``KiviMgpuConfig()`` / ``PlanarS8Config()`` default config.
``--interpret`` (mgpu_kivi / mgpu_planar / mgpu_planar_s8 only, for CPU tests): the kernel module's plain-JAX twin instead of the Mosaic kernel -- not a profile.
The driver's ``tuned`` impl is what the dispatcher runs (``pallas_kernels.decode_tuning.choose`` on the shipped
table for ``--device-kind``), profiled only where it differs from the v1 / ws default.

Kernel names (``--kernel-regex impl=PATTERN`` to change): the Mosaic GPU kernels are ``plgpu.kernel(body, ...)``:
the host function is ``body_mosaic_gpu`` (``_lower_as_gpu_kernel``), the outlined device kernel
``body_mosaic_gpu_kernel`` -> ``mosaic_gpu`` (v1, ws, mgpu_kivi, mgpu_planar, mgpu_planar_s8); the Triton kernel is the ``pallas_call`` name
``decode_attention_<k>_<v>`` -> ``decode_attention``; cuDNN's fused attention kernel (``cudnn_generated_...sdpa...``,
``...flash_fprop...``) -> ``sdpa|fmha|flash|cudnn``.  Not checked on a device when written.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import io
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HERE = os.path.abspath(__file__)

# ---------------------------------------------------------------------------------------------------------------
# metrics (Hopper, ncu >= 2023): name -> the row field it fills
# ---------------------------------------------------------------------------------------------------------------
STALL_REASONS = ("long_scoreboard", "barrier", "wait", "mio_throttle", "math_pipe_throttle", "short_scoreboard",
                 "lg_throttle", "membar", "sleeping", "no_instruction", "dispatch_stall", "branch_resolving",
                 "not_selected", "selected", "drain", "imc_miss", "tex_throttle", "misc")
STALL_FMT = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
STALL_RE = re.compile(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")

FIELDS = {                                 # metric -> (row field, kind): kind converts the value (see unit_scale)
    "gpu__time_duration.sum": ("duration_us", "time_us"),
    "dram__bytes_read.sum": ("dram_read_bytes", "bytes"),
    "dram__bytes_write.sum": ("dram_write_bytes", "bytes"),
    "dram__bytes_op_read.sum": ("dram_read_bytes", "bytes"),      # the names of newer ncu versions (ALTERNATES)
    "dram__bytes_op_write.sum": ("dram_write_bytes", "bytes"),
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": ("dram_pct_peak", "pct"),
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": ("sm_pct_peak", "pct"),
    "lts__t_sector_hit_rate.pct": ("l2_hit_pct", "pct"),
    "sm__warps_active.avg.pct_of_peak_sustained_active": ("achieved_occupancy_pct", "pct"),
    "sm__maximum_warps_per_active_cycle_pct": ("theoretical_occupancy_pct", "pct"),
    "smsp__issue_active.avg.pct_of_peak_sustained_active": ("issue_active_pct", "pct"),
    "smsp__warps_eligible.avg.per_cycle_active": ("eligible_warps_per_cycle", "count"),
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active": ("gmma_pipe_pct", "pct"),
    "launch__registers_per_thread": ("registers_per_thread", "count"),
    "launch__shared_mem_per_block_dynamic": ("smem_dynamic_bytes", "bytes"),
    "launch__shared_mem_per_block_static": ("smem_static_bytes", "bytes"),
    "launch__block_size": ("block_size", "count"),
    "launch__grid_size": ("grid_size", "count"),
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum": ("smem_bank_conflicts", "count"),
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": ("smem_bank_conflicts_ld", "count"),
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum": ("smem_bank_conflicts_st", "count"),
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum": ("smem_wavefronts", "count"),
    "smsp__inst_executed.sum": ("inst_executed", "count"),
    # local memory (register spills, local arrays): bytes through L1TEX, and the SASS instructions
    "l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum": ("local_load_bytes", "bytes"),
    "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum": ("local_store_bytes", "bytes"),
    "l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum": ("local_load_bytes", "sectors"),    # alternates (32 B each)
    "l1tex__t_sectors_pipe_lsu_mem_local_op_st.sum": ("local_store_bytes", "sectors"),
    "smsp__sass_inst_executed_op_local_ld.sum": ("local_load_inst", "count"),
    "smsp__sass_inst_executed_op_local_st.sum": ("local_store_inst", "count"),
}
# a metric ncu refuses is replaced by its alternate (once)
ALTERNATES = {"dram__bytes_read.sum": "dram__bytes_op_read.sum", "dram__bytes_write.sum": "dram__bytes_op_write.sum",
              "l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum": "l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum",
              "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum": "l1tex__t_sectors_pipe_lsu_mem_local_op_st.sum"}
METRICS = tuple(m for m in FIELDS if m not in ALTERNATES.values()) + tuple(STALL_FMT.format(r) for r in STALL_REASONS)
# the fallback if a re-run without the unknown metrics still fails on metric names
CORE_METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
                "sm__warps_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread",
                "launch__shared_mem_per_block_dynamic")

KERNEL_REGEX = {"v1": "mosaic_gpu", "ws": "mosaic_gpu", "mgpu_kivi": "mosaic_gpu", "mgpu_planar": "mosaic_gpu", "mgpu_planar_s8": "mosaic_gpu",
                "triton": "decode_attention",
                "cudnn": "sdpa|fmha|flash|cudnn"}
IMPLS = ("v1", "ws", "mgpu_kivi", "mgpu_planar", "mgpu_planar_s8", "triton", "cudnn")
DRIVER_IMPLS = IMPLS + ("tuned",)
FORMATS = ("bf16", "int8", "int4")
# formats the v1 / ws Mosaic kernels do not read: profiled with impl "triton", the KIVI ones also with "mgpu_kivi"
TRITON_ONLY_FORMATS = ("int2", "qserve", "kivi2", "kivi4")
# the formats of the Mosaic GPU KIVI kernel (impl "mgpu_kivi"): KIVI-<bits>, K groups of 32 tokens, V of 32 channels
KIVI_FORMATS = ("kivi2", "kivi4")
# the formats of the token-planar kernel (impl "mgpu_planar", decode_attention_mgpu_planar: per-token keys)
PLANAR_FORMATS = ("int2", "qserve", "int4")
KIVI_GROUPS = (32, 32)


# ---------------------------------------------------------------------------------------------------------------
# parsing ncu --csv (no GPU, no JAX)
# ---------------------------------------------------------------------------------------------------------------
_PREFIX = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "m": 1e-3, "u": 1e-6, "n": 1e-9, "p": 1e-12}
_BIN = {"KiB": 2.0 ** 10, "MiB": 2.0 ** 20, "GiB": 2.0 ** 30, "TiB": 2.0 ** 40, "Kibyte": 2.0 ** 10,
        "Mibyte": 2.0 ** 20, "Gibyte": 2.0 ** 30}
_BASES = ("byte", "second", "cycle", "inst", "warp", "thread", "register", "block", "sector", "request",
          "wavefront", "transaction", "hz", "Hz", "B", "s")


def _one_unit(u: str) -> tuple[float, str]:
    """``(factor, base)`` of one unit word: "Mbyte" -> (1e6, "byte"), "usecond" -> (1e-6, "second")."""
    u = u.strip()
    if u in _BIN:
        return _BIN[u], "byte"
    if u in ("", "%"):
        return 1.0, u
    for base in _BASES:
        if u.endswith(base) and u[: -len(base)] in _PREFIX:
            canon = {"B": "byte", "s": "second", "hz": "Hz"}.get(base, base)
            return _PREFIX[u[: -len(base)]], canon
    return 1.0, u


def unit_scale(unit: str) -> tuple[float, str]:
    """``(factor, base unit)`` of an ncu unit: value x factor is in the base unit.  "Kbyte/block" -> (1e3,
    "byte/block"); "Tbyte/second" -> (1e12, "byte/second"); "byte/usecond" -> (1e6, "byte/second"); "%" -> (1, "%");
    a unit it does not know -> (1, the unit)."""
    parts = (unit or "").split("/")
    f, base = _one_unit(parts[0])
    bases = [base]
    for p in parts[1:]:
        g, b = _one_unit(p)
        f /= g
        bases.append(b)
    return f, "/".join(bases)


def parse_number(text: str) -> float | None:
    """ncu's printed value as a float: thousands separators dropped ("1,234,567.5" -> 1234567.5); "n/a", "" ->
    None."""
    t = (text or "").strip().replace(",", "").replace("\u202f", "").replace(" ", "")
    if t in ("", "n/a", "N/A", "-"):
        return None
    try:
        return float(t)
    except ValueError:
        return None


def parse_ncu_csv(text: str) -> list[dict]:
    """The profiled launches of an ncu ``--csv`` log (long format: one row per metric; lines that are not CSV --
    ``==PROF==`` / ``==WARNING==`` / the application's own output -- are skipped).  Each launch: ``id``,
    ``kernel``, ``process``, ``block_size``, ``grid_size`` (where the columns exist) and ``metrics``: name ->
    ``{"value": float in the base unit, "unit": base unit, "raw": printed value, "raw_unit": printed unit}``."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"') and '"Metric Name"' in ln), None)
    if start is None:
        return []
    body = [lines[start]] + [ln for ln in lines[start + 1:] if ln.startswith('"')]
    launches: dict[str, dict] = {}
    for rec in csv.DictReader(io.StringIO("\n".join(body))):
        lid = rec.get("ID")
        name = rec.get("Metric Name")
        if lid is None or not name or lid == "ID":          # a repeated header
            continue
        la = launches.setdefault(lid, dict(id=lid, kernel=rec.get("Kernel Name", ""),
                                           process=rec.get("Process Name", ""),
                                           block_size=rec.get("Block Size"), grid_size=rec.get("Grid Size"),
                                           metrics={}))
        raw, raw_unit = rec.get("Metric Value", ""), rec.get("Metric Unit", "")
        v = parse_number(raw)
        f, base = unit_scale(raw_unit)
        la["metrics"][name] = dict(value=None if v is None else v * f, unit=base, raw=raw, raw_unit=raw_unit)
    return list(launches.values())


def _convert(m: dict, kind: str):
    """One metric record as its row field: time -> µs, bytes -> bytes, pct / count -> the number."""
    v = m.get("value")
    if v is None:
        return None
    if kind == "time_us":
        if not m["unit"].startswith("second"):
            raise ValueError(f"duration unit {m['raw_unit']!r} is not a time")
        return v * 1e6
    if kind == "bytes":
        if not m["unit"].startswith("byte"):
            raise ValueError(f"unit {m['raw_unit']!r} is not bytes")
        return v
    if kind == "sectors":                              # L1TEX / L2 sectors of 32 bytes -> bytes
        if not m["unit"].startswith("sector"):
            raise ValueError(f"unit {m['raw_unit']!r} is not sectors")
        return v * 32
    return v


def launch_fields(launch: dict, top: int = 4) -> dict:
    """The row fields of one parsed launch (:data:`FIELDS`; ``stalls``: every stall reason's warps-stalled per
    issued instruction, ``top_stalls``: the ``top`` largest, "selected" left out: it is issuing, not stalled)."""
    met = launch["metrics"]
    out = dict(kernel=launch["kernel"])
    for name, (field, kind) in FIELDS.items():
        if name in met:
            out[field] = _convert(met[name], kind)
    stalls = {}
    for name, m in met.items():
        mm = STALL_RE.match(name)
        if mm and m.get("value") is not None:
            stalls[mm.group(1)] = m["value"]
    out["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1]))
    out["top_stalls"] = [[k, v] for k, v in out["stalls"].items() if k != "selected"][:top]
    if out.get("dram_read_bytes") and out.get("duration_us"):
        out["dram_read_tbps"] = out["dram_read_bytes"] / (out["duration_us"] * 1e-6) / 1e12
    return out


_NO_KERNEL = re.compile(r"No kernels were profiled", re.I)
# "==ERROR== Failed to find metric regex:^dram__bytes_read\.(sum|...)$" (ncu 2023-2025); "unknown metric NAME"
_BAD_METRIC = re.compile(r"(?:Failed to find|unknown|invalid)\s+metrics?\s*:?\s*['\"]?(?:regex:)?\^?([A-Za-z0-9_]+)",
                         re.I)


def ncu_messages(text: str) -> dict:
    """ncu's own diagnostics in a log: ``errors`` (==ERROR== lines), ``warnings``, ``no_kernel`` (nothing matched
    the filter), ``bad_metrics`` (metric names ncu refused)."""
    errors = [ln.strip() for ln in text.splitlines() if ln.startswith("==ERROR==")]
    warnings = [ln.strip() for ln in text.splitlines() if ln.startswith("==WARNING==")]
    bad = sorted({m.group(1) for ln in errors for m in _BAD_METRIC.finditer(ln)})
    return dict(errors=errors, warnings=warnings, no_kernel=bool(_NO_KERNEL.search(text)), bad_metrics=bad)


def case_row(case: dict, text: str, *, info: dict | None = None, rc: int | None = None,
             timed_out: bool = False, regex: str = "") -> dict:
    """One result row from a case's ncu log.  ``status``: "ok", "no kernel matched" (the row says the regex),
    "timeout", "ncu failed" (rc / errors quoted), "no csv"."""
    launches = parse_ncu_csv(text)
    msg = ncu_messages(text)
    row = dict(case, regex=regex, rc=rc, launches=len(launches))
    if info:
        row["child"] = info
        if info.get("read_bytes"):
            row["expected_read_bytes"] = info["read_bytes"]
    if msg["errors"]:
        row["ncu_errors"] = msg["errors"][:8]
    if launches:
        row.update(launch_fields(launches[0]))
        if len(launches) > 1:
            row["other_kernels"] = sorted({la["kernel"] for la in launches[1:]})[:8]
        if row.get("expected_read_bytes") and row.get("dram_read_bytes"):
            row["dram_read_over_expected"] = row["dram_read_bytes"] / row["expected_read_bytes"]
        row["status"] = "ok"
    elif timed_out:
        row["status"] = "timeout"
    elif msg["no_kernel"]:
        row["status"] = f"no kernel matched regex:{regex}"
    elif rc not in (0, None) or msg["errors"]:
        row["status"] = "ncu failed"
        row["rc_note"] = "ncu or the child exited non-zero (see ncu_errors / stdout_tail)"
    else:
        row["status"] = "no csv"
    return row


# ---------------------------------------------------------------------------------------------------------------
# markdown
# ---------------------------------------------------------------------------------------------------------------
def _f(x, fmt="{:.1f}"):
    return "" if x is None else fmt.format(x)


def markdown(results: dict) -> str:
    lines = [f"{results.get('date')}; {results.get('ncu_version', 'ncu ?')}; B={results['shape']['B']} "
             f"Hq={results['shape']['hq']} Hkv={results['shape']['hkv']} D={results['shape']['d']}; "
             f"metrics: {len(results.get('metrics', []))}; one launch per case after {results.get('warmup')} "
             "warm-up calls, `--clock-control none`, caches flushed before it (ncu default)", "",
             "| T | impl | format | config | kernel | µs | DRAM read MB (/ expected) | DRAM TB/s | DRAM % peak | "
             "occupancy % | regs/thr | smem KB/blk | smem bank confl. | top stalls (warps / issued inst) | "
             "local ld / st KB (spills) | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        smem = None
        if r.get("smem_dynamic_bytes") is not None:
            smem = (r["smem_dynamic_bytes"] + (r.get("smem_static_bytes") or 0)) / 1024
        read = _f(r.get("dram_read_bytes") and r["dram_read_bytes"] / 1e6)
        if read and r.get("dram_read_over_expected"):
            read += f" ({r['dram_read_over_expected']:.2f}x)"
        stalls = ", ".join(f"{k} {v:.2f}" for k, v in r.get("top_stalls", []))
        local = ""
        if r.get("local_load_bytes") is not None or r.get("local_store_bytes") is not None:
            local = (f"{_f(r.get('local_load_bytes') and r['local_load_bytes'] / 1024) or '?'} / "
                     f"{_f(r.get('local_store_bytes') and r['local_store_bytes'] / 1024) or '?'}")
        kern = (r.get("kernel") or "")[:48]
        status = r.get("status", "")
        if r.get("dropped_metrics"):
            status += f"; dropped {', '.join(r['dropped_metrics'])}"
        if status.startswith("no kernel") and r.get("kernels_seen"):
            status += f"; seen: {', '.join(k[:40] for k in r['kernels_seen'][:6])}"
        if r.get("ncu_errors") and status != "ok":
            status += f"; {r['ncu_errors'][0][:160]}"
        lines.append(f"| {r['T']} | {r['impl']} | {r['format']} | {r.get('variant', '')} | `{kern}` | "
                     f"{_f(r.get('duration_us'))} | {read} | {_f(r.get('dram_read_tbps'), '{:.2f}')} | "
                     f"{_f(r.get('dram_pct_peak'))} | {_f(r.get('achieved_occupancy_pct'))} | "
                     f"{_f(r.get('registers_per_thread'), '{:.0f}')} | {_f(smem)} | "
                     f"{_f(r.get('smem_bank_conflicts'), '{:.0f}')} | {stalls} | {local} | {status} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# child: one case, the kernel called --warmup + --calls times (what ncu attaches to)
# ---------------------------------------------------------------------------------------------------------------
def pair_refusal(impl: str, fmt: str) -> str | None:
    """Why ``impl`` does not profile ``fmt`` (None when it does): the driver skips such pairs, the child refuses."""
    if impl == "cudnn" and fmt != "bf16":
        return "cudnn: bf16 only"
    if impl == "mgpu_kivi" and fmt not in KIVI_FORMATS:
        return f"mgpu_kivi: the Mosaic GPU KIVI kernel reads {', '.join(KIVI_FORMATS)} only"
    if impl in ("mgpu_planar", "mgpu_planar_s8") and fmt not in PLANAR_FORMATS:
        return f"{impl}: the token-planar kernel reads {', '.join(PLANAR_FORMATS)} only"
    if impl in ("v1", "ws") and fmt in TRITON_ONLY_FORMATS:
        other = (" or the Mosaic GPU KIVI kernel (mgpu_kivi)" if fmt in KIVI_FORMATS
                 else " or the token-planar kernel (mgpu_planar)" if fmt in PLANAR_FORMATS else "")
        return f"{impl}: no {fmt} path (read by the Triton kernel{other})"
    return None


def child(a) -> dict:
    import jax
    import jax.numpy as jnp
    import bench_decode_attention as bench
    import check_mgpu_decode as cmd
    from kvquant_jax.attention.synthetic import PRESETS, kivi_formats
    from pallas_kernels import decode_attention_mgpu_kivi as mk
    from pallas_kernels import decode_attention_mgpu_planar as mp
    from pallas_kernels import decode_attention_mgpu_planar_s8 as s8
    from pallas_kernels.decode_attention_mgpu import default_mgpu_config
    from pallas_kernels.decode_attention_mgpu_ws import default_ws_config

    why = pair_refusal(a.impl, a.format)
    if why:
        raise SystemExit(why)
    if a.interpret and a.impl not in ("mgpu_kivi", "mgpu_planar", "mgpu_planar_s8"):
        raise SystemExit("--interpret: mgpu_kivi / mgpu_planar / mgpu_planar_s8 only (the plain-JAX twin of their "
                         "kernel)")
    b, hq, hkv, d, t = a.B, a.hq, a.hkv, a.d, a.T
    key, q = cmd.timing_query(t, b, hq, d)
    bench.MAX_SETS = a.sets                            # region_sets: the first a.sets of the timing's sets
    info = dict(impl=a.impl, format=a.format, T=t, B=b, hq=hq, hkv=hkv, d=d, device=str(jax.devices()[0]))
    if a.impl == "cudnn":
        fn, arg = jax.jit(bench.baseline_fns()["cudnn"]), cmd.cudnn_sets(key, b, hkv, t, d, 1)[0]
        info["read_bytes"] = 2 * b * hkv * t * d * 2 + q.size * 2
    elif a.impl in ("mgpu_kivi", "mgpu_planar", "mgpu_planar_s8"):   # check_mgpu_kivi / _planar timing's inputs, call
        dflt, splits = mk.KiviMgpuConfig(), lambda ops, g, cfg: mk._spec_for(ops, g, cfg).ns
        if a.impl == "mgpu_kivi":
            kf, vf = kivi_formats(int(a.format[len("kivi"):]), *KIVI_GROUPS)
            prepare, entry = mk.prepare_kivi_region, mk.decode_attention_mgpu_kivi_prepared
        elif a.impl == "mgpu_planar":
            kf, vf = PRESETS[a.format]
            prepare, entry = mp.prepare_token_planar_region, mp.decode_attention_mgpu_planar_prepared
        else:
            kf, vf = PRESETS[a.format]
            prepare, entry = mp.prepare_token_planar_region, s8.decode_attention_mgpu_planar_s8_prepared
            dflt, splits = s8.PlanarS8Config(), lambda ops, g, cfg: s8._spec(ops, g, cfg).ns
        regs, _ = bench.region_sets(key, kf, vf, b, hkv, t, d)
        ops = jax.block_until_ready(jax.jit(prepare)(regs[0]))    # outside the profiled call
        del regs
        over = json.loads(a.config) if a.config else {}
        cfg = dataclasses.replace(dflt, **over)
        interp = bool(a.interpret)
        fn = jax.jit(lambda q, o: entry(q, o, config=cfg, out_dtype=jnp.float32, interpret=interp))
        arg = ops
        info["config"] = dataclasses.asdict(cfg)
        info["num_splits"] = splits(ops, hq // hkv, cfg)                # the resolved split count (grid y)
        info["read_bytes"] = cmd.mgpu_read_bytes(ops, q)
        if interp:
            info["interpret"] = True
    else:
        kf, vf = bench.FORMATS[a.format] if a.format in bench.FORMATS else PRESETS[a.format]
        regs, set_bytes = bench.region_sets(key, kf, vf, b, hkv, t, d)
        if a.impl == "triton":
            fn, arg = jax.jit(cmd.triton_fn()), regs[0]
            info["read_bytes"] = set_bytes + q.size * 2
        else:
            ops = cmd.prepared_sets(regs[:1])[0]
            del regs
            over = json.loads(a.config) if a.config else {}
            if a.impl == "v1":
                cfg = dataclasses.replace(default_mgpu_config(kf), **over)
                fn = jax.jit(cmd.mgpu_fn(cfg))
            else:
                cfg = dataclasses.replace(default_ws_config(kf), **over)
                fn = jax.jit(cmd.mgpu_ws_fn(cfg))
            arg = ops
            info["config"] = dataclasses.asdict(cfg)
            info["read_bytes"] = cmd.mgpu_read_bytes(ops, q)
    t0 = time.perf_counter()
    jax.block_until_ready(fn(q, arg))                   # compile + first call
    info["compile_s"] = time.perf_counter() - t0
    for _ in range(a.warmup - 1):
        jax.block_until_ready(fn(q, arg))
    walls = []
    for _ in range(a.calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(q, arg))
        walls.append((time.perf_counter() - t0) * 1e6)
    info["host_us_median"] = statistics.median(walls)   # under ncu: replays, not a timing
    info["warmup"], info["calls"] = a.warmup, a.calls
    if a.info_out:
        with open(a.info_out, "w") as f:
            json.dump(info, f, indent=1, default=str)
    print("NCU_CHILD " + json.dumps(info, default=str), flush=True)
    return info


# ---------------------------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------------------------
def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def tuned_cases(formats, ts, d, g, device_kind) -> list[dict]:
    """The dispatcher's choice per (format, T) (``decode_tuning.choose`` on the shipped table), as a case, where it
    is not the v1 / ws default config (those run anyway)."""
    from kvquant_jax.attention.synthetic import PRESETS
    from pallas_kernels import decode_tuning
    from pallas_kernels.decode_attention_mgpu import MgpuConfig, default_mgpu_config
    from pallas_kernels.decode_attention_mgpu_ws import MgpuWsConfig, default_ws_config

    out = []
    for fmt in formats:
        if fmt in TRITON_ONLY_FORMATS:                 # no v1 / ws path (decode_tuning: the v1 / ws table)
            continue
        kf = PRESETS[fmt][0]
        for t in ts:
            impl, fields, why = decode_tuning.choose(device_kind, kf.payload, d, g, t)
            if impl == "mgpu_ws":
                cfg, dflt, name = MgpuWsConfig(**fields), default_ws_config(kf), "ws"
            else:
                cfg, dflt, name = (MgpuConfig(**fields) if fields else default_mgpu_config(kf),
                                   default_mgpu_config(kf), "v1")
            if cfg == dflt:
                log(f"tuned {fmt} T={t}: {name} default ({why}): profiled as {name}")
                continue
            over = {k: v for k, v in dataclasses.asdict(cfg).items() if getattr(dflt, k) != v}
            out.append(dict(impl=name, format=fmt, T=t, variant=f"tuned {json.dumps(over, sort_keys=True)}",
                            config=json.dumps(over, sort_keys=True), why=why))
    return out


def build_cases(a) -> list[dict]:
    """The cases of the driver, in order: per T cuDNN (bf16), then per format v1, ws, mgpu_kivi, mgpu_planar, mgpu_planar_s8, triton;
    then the tuned ones.  A requested (impl, format) pair that makes no sense (:func:`pair_refusal`) is left out and
    recorded in ``a.skipped`` (``[impl, format, why]``, once per pair)."""
    cases, skipped = [], []
    for t in a.T:
        if "cudnn" in a.impls and "bf16" in a.formats:
            cases.append(dict(impl="cudnn", format="bf16", T=t, variant="", config=""))
        for fmt in a.formats:
            for impl in ("v1", "ws", "mgpu_kivi", "mgpu_planar", "mgpu_planar_s8", "triton"):
                if impl not in a.impls:
                    continue
                why = pair_refusal(impl, fmt)
                if why:
                    if [impl, fmt, why] not in skipped:
                        skipped.append([impl, fmt, why])
                    continue
                cases.append(dict(impl=impl, format=fmt, T=t, variant="default", config=""))
                for ci, (cimpl, over) in enumerate(getattr(a, "configs", []) or []):   # --configs IMPL=JSON
                    if cimpl == impl:
                        cases.append(dict(impl=impl, format=fmt, T=t, variant=f"config {over}", config=over,
                                          tag=f"_c{ci}"))
    a.skipped = skipped
    if "tuned" in a.impls:
        cases += tuned_cases(a.formats, a.T, a.d, a.hq // a.hkv, a.device_kind)
    return cases


def _case_name(c: dict) -> str:
    tag = c.get("tag") or ("" if not c.get("config") else "_tuned")
    return f"{c['impl']}_{c['format']}_T{c['T']}{tag}"


def child_argv(a, c: dict, info_out: str) -> list[str]:
    argv = [sys.executable, HERE, "--child", "--impl", c["impl"], "--format", c["format"], "--T", str(c["T"]),
            "--B", str(a.B), "--hq", str(a.hq), "--hkv", str(a.hkv), "--d", str(a.d), "--warmup", str(a.warmup),
            "--calls", str(a.calls), "--sets", "1", "--info-out", info_out]
    if c.get("config"):
        argv += ["--config", c["config"]]
    return argv


def ncu_argv(a, regex: str, metrics, log_file: str, *, skip: int, count: int, filtered: bool = True) -> list[str]:
    cmd = [a.ncu, "--clock-control", "none", "--target-processes", "all"]
    if filtered:
        cmd += ["--kernel-name", f"regex:{regex}"]
    cmd += ["--launch-skip", str(skip), "--launch-count", str(count), "--csv"]
    if getattr(a, "print_units", True):          # base units (the parser converts ncu's auto units as well)
        cmd += ["--print-units", "base"]
    cmd += ["--log-file", log_file, "--metrics", ",".join(metrics)] + shlex.split(a.ncu_extra)
    return cmd


def _run(cmd, timeout, env) -> tuple[int | None, bool, str]:
    """``(rc, timed_out, stdout+stderr)``.  ncu and the child run in a session of their own: on timeout the whole
    process group is killed (``subprocess.run`` alone would leave the child holding the GPU)."""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         errors="replace", start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, False, out
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        out, _ = p.communicate()
        return None, True, out


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def refused(metrics, bad_names) -> list[str]:
    """The requested metrics ncu refused: ``bad_names`` (from :func:`ncu_messages`) are full names or base names
    (the part before the first ".")."""
    bad = set(bad_names)
    return [m for m in metrics if m in bad or m.split(".")[0] in bad]


def run_case(a, c: dict, out: str, env) -> dict:
    name = _case_name(c)
    regex = a.kernel_regex[c["impl"]]
    info_out = os.path.join(out, f"{name}.child.json")
    metrics = list(a.metrics)
    dropped: list[str] = []
    for attempt in range(8):             # one re-run per batch of refused metrics (an ncu may name one at a time)
        log_file = os.path.join(out, f"ncu_{name}.log")
        for stale in (log_file, info_out):
            if os.path.exists(stale):
                os.remove(stale)
        cmd = ncu_argv(a, regex, metrics, log_file, skip=a.warmup, count=1) + child_argv(a, c, info_out)
        log(f"case {name} (attempt {attempt + 1}, timeout {a.case_timeout} s): {shlex.join(cmd)}")
        t0 = time.time()
        rc, timed_out, tail = _run(cmd, a.case_timeout, env)
        text = _read(log_file)
        with open(os.path.join(out, f"{name}.stdout.txt"), "w") as f:
            f.write(tail)
        if not parse_ncu_csv(text) and parse_ncu_csv(tail):   # an ncu that wrote its CSV to stdout after all
            text = text + "\n" + tail
        info = json.loads(_read(info_out) or "null")
        row = case_row(c, text, info=info, rc=rc, timed_out=timed_out, regex=regex)
        row["wall_s"] = round(time.time() - t0, 1)
        if row["status"] != "ncu failed":              # ok, no kernel matched, timeout: nothing to retry
            break
        msg = ncu_messages(text + "\n" + tail)
        bad = refused(metrics, msg["bad_metrics"])
        if "print-units" in text + tail and getattr(a, "print_units", True):     # an ncu without the option
            a.print_units = False
            log(f"case {name}: re-running without --print-units (ncu's auto units, converted by the parser)")
            continue
        if bad:                                          # ncu named metrics it does not know: drop, re-run
            dropped += bad
            metrics = [m for m in metrics if m not in bad]
            metrics += [ALTERNATES[m] for m in bad if m in ALTERNATES and ALTERNATES[m] not in dropped]
        elif any("metric" in e.lower() for e in msg["errors"]) and set(metrics) - set(CORE_METRICS):
            dropped += [m for m in metrics if m not in CORE_METRICS]     # unnamed metric trouble: the core set
            metrics = [m for m in metrics if m in CORE_METRICS]
        else:
            break
        log(f"case {name}: ncu refused metrics; re-running without {bad or 'all but the core set'}")
    if dropped:
        row["dropped_metrics"] = dropped
        if row["status"] == "ok":                        # the later cases ask for the metrics this ncu has
            a.metrics = metrics
            a.dropped_metrics = sorted(set(getattr(a, "dropped_metrics", [])) | set(dropped))
    if row["status"] != "ok":
        row["stdout_tail"] = tail[-1500:]
    if row["status"].startswith("no kernel") and a.list_on_miss:
        row["kernels_seen"] = list_kernels(a, c, out, env)
    return row


def list_kernels(a, c: dict, out: str, env) -> list[str]:
    """The kernel names of the first ``--list-count`` launches of the case, no name filter (one cheap metric)."""
    name = _case_name(c)
    log_file = os.path.join(out, f"ncu_{name}_list.log")
    cmd = ncu_argv(a, "", ["gpu__time_duration.sum"], log_file, skip=0, count=a.list_count, filtered=False) + \
        child_argv(a, c, os.path.join(out, f"{name}_list.child.json"))
    log(f"case {name}: regex matched nothing; listing kernel names: {shlex.join(cmd)}")
    _run(cmd, a.case_timeout, env)
    names = []
    for la in parse_ncu_csv(_read(log_file)):
        if la["kernel"] not in names:
            names.append(la["kernel"])
    log(f"case {name}: kernels seen: {names}")
    return names


def ncu_version(ncu: str) -> str:
    try:
        p = subprocess.run([ncu, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
        return " ".join(p.stdout.strip().splitlines()[-1:]) or f"rc {p.returncode}"
    except (OSError, subprocess.SubprocessError) as e:
        return f"ncu not runnable: {type(e).__name__}: {e}"


def flush(results: dict, out: str) -> None:
    with open(os.path.join(out, "ncu_decode.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(out, "ncu_decode.md"), "w") as f:
        f.write(markdown(results))


def driver(a) -> dict:
    out = a.out or os.environ.get("OUT") or "/tmp/ncu_decode"
    os.makedirs(out, exist_ok=True)
    a.ncu = shutil.which(a.ncu) or a.ncu
    results = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   argv=sys.argv[1:], ncu=a.ncu, ncu_version=ncu_version(a.ncu), warmup=a.warmup,
                   shape=dict(B=a.B, hq=a.hq, hkv=a.hkv, d=a.d), metrics=list(a.metrics),
                   kernel_regex=a.kernel_regex, rows=[])
    log(f"{results['ncu_version']}; out {out}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(HERE)), env.get("PYTHONPATH"))
                                        if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if a.no_command_buffers:                     # plain launches instead of CUDA graphs (ncu profiles both)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    cases = build_cases(a)
    results["skipped"] = a.skipped
    for impl, fmt, why in a.skipped:
        log(f"skipped {impl} x {fmt}: {why}")
    log(f"{len(cases)} cases: {[_case_name(c) for c in cases]}")
    if not cases and a.skipped:
        flush(results, out)
        raise SystemExit(f"no case to profile: {'; '.join(w for _, _, w in a.skipped)}")
    for c in cases:
        row = run_case(a, c, out, env)
        results["rows"].append(row)
        results["dropped_metrics"] = getattr(a, "dropped_metrics", [])
        log(f"case {_case_name(c)}: {row['status']} {row.get('kernel', '')[:60]} "
            f"{_f(row.get('duration_us'))} us dram {_f(row.get('dram_pct_peak'))} % ({row['wall_s']} s)")
        flush(results, out)
    flush(results, out)
    print(markdown(results), flush=True)
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", action="store_true", help="one case (what ncu runs)")
    p.add_argument("--impl", choices=IMPLS, default="v1", help="--child: the kernel")
    p.add_argument("--format", choices=FORMATS + ("e4m3",) + TRITON_ONLY_FORMATS, default="int4", help="--child: the KV format")
    p.add_argument("--config", default="", help="--child: JSON fields over the v1 / ws / mgpu_kivi default config")
    p.add_argument("--interpret", action="store_true",
                   help="--child, mgpu_kivi only: the kernel's plain-JAX twin (CPU tests; not a profile)")
    p.add_argument("--sets", type=int, default=1, help="--child: input sets built (the first is called)")
    p.add_argument("--info-out", default="", help="--child: write the case's info (bytes, config) here")
    p.add_argument("--T", default="32768", help="T (driver: comma separated)")
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3, help="calls before the profiled one (= ncu --launch-skip)")
    p.add_argument("--calls", type=int, default=3, help="calls after the warm-up (the first one is profiled)")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--impls", default=",".join(DRIVER_IMPLS))
    p.add_argument("--kernel-regex", action="append", default=[], metavar="IMPL=PATTERN",
                   help=f"kernel-name regex per impl (defaults {KERNEL_REGEX})")
    p.add_argument("--configs", action="append", default=[], metavar="IMPL=JSON",
                   help="driver: also profile IMPL with these config fields (per T and format it reads), e.g. "
                        "mgpu_planar_s8='{\"pv_limbs\": 2}'")
    p.add_argument("--metrics", default=",".join(METRICS))
    p.add_argument("--ncu", default=os.environ.get("NCU", "ncu"))
    p.add_argument("--ncu-extra", default="", help="more ncu arguments (shell-quoted string)")
    p.add_argument("--case-timeout", type=int, default=300, help="seconds per ncu case")
    p.add_argument("--no-list-on-miss", dest="list_on_miss", action="store_false")
    p.add_argument("--list-count", type=int, default=40, help="launches listed when the regex matched nothing")
    p.add_argument("--no-command-buffers", action="store_true", help="XLA_FLAGS=--xla_gpu_enable_command_buffer=")
    p.add_argument("--device-kind", default="NVIDIA H200", help="the tuning table the 'tuned' cases come from")
    p.add_argument("--parse", default="", metavar="NCU_LOG", help="print the rows parsed from a saved ncu log")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if a.parse:
        rows = [launch_fields(la) for la in parse_ncu_csv(_read(a.parse))]
        print(json.dumps(rows, indent=1))
        return rows
    if a.child:
        a.T = int(a.T)
        return child(a)
    a.T = [int(x) for x in a.T.split(",") if x]
    a.formats = [x for x in a.formats.split(",") if x]
    a.impls = [x for x in a.impls.split(",") if x]
    configs = []
    for item in a.configs:
        impl, sep, over = item.partition("=")
        if not sep or impl not in IMPLS:
            raise SystemExit(f"--configs {item!r}: IMPL=JSON with IMPL one of {', '.join(IMPLS)}")
        try:
            fields = json.loads(over)
        except json.JSONDecodeError as err:
            raise SystemExit(f"--configs {item!r}: not JSON ({err})") from None
        if not isinstance(fields, dict):
            raise SystemExit(f"--configs {item!r}: a JSON object of config fields")
        configs.append((impl, json.dumps(fields, sort_keys=True)))
    a.configs = configs
    bad = sorted(set(a.impls) - set(DRIVER_IMPLS)) + sorted(set(a.formats) - set(FORMATS) - set(TRITON_ONLY_FORMATS))
    if bad:
        p.error(f"unknown impls / formats {bad}")
    regex = dict(KERNEL_REGEX)
    for kv in a.kernel_regex:
        k, _, v = kv.partition("=")
        if k not in regex or not v:
            p.error(f"--kernel-regex {kv!r}: IMPL=PATTERN with IMPL in {list(regex)}")
        regex[k] = v
    a.kernel_regex = regex
    a.metrics = [m for m in a.metrics.split(",") if m]
    return driver(a)


if __name__ == "__main__":
    main()
