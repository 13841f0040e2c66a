"""End-to-end serving benchmark: decode ms/step, prefill tokens/s, capacity and the byte roofline of every row.

    python experiments/bench_serving.py --model llama3-8b-shaped --cache bf16 int8 int4 int2 kivi2 \
        --batch 8 --T 32768 --out docs/results/serving                       # GPU (H200)
    python experiments/bench_serving.py --model tiny --T 256 --steps 8       # CPU smoke run
    python experiments/bench_serving.py --cache bf16 int4 --batch 8 --T 32768 --mesh none data=1,model=1 --reps 5
                                   # the sharded code path on a 1 x 1 mesh vs the plain one (issue N, <= 5%)
    python experiments/bench_serving.py --cache bf16 int4 --batch 8 --T 32768 --reduction fast fixed_order
                                   # the fixed-order (mesh- and batch-invariant) numerics' cost (vs_fast)

Rows:
* **decode**: a cache of ``--cache`` filled with ``T`` random rows per sequence through the scheme's own append
  (``ops.try_append``; speed does not depend on the values), then ``serving.generate.decode_loop`` (greedy, the
  cache donated) for ``--steps`` tokens, median over ``--reps`` runs of ms per forward step. ``layout``: "serving"
  = unstacked params + one cache group per layer (the unrolled step: every layer's weights and cache buffers read
  in place), "stacked" = stacked params + stacked cache groups under ``lax.scan`` (the layout before issue I).
  ``attention_impl``: "auto" (the kernel path on GPU) or "reference".
* **roofline**: bytes one decode step must read = every weight (the tied head reads the embedding once) + the live
  cache bytes of the ledger (``quant.ledger``, ``read_per_step`` at length T) ÷ the copy bandwidth measured in
  the same run (read + write of a 2 GiB buffer); ``frac`` = roofline / measured.
* **capacity**: the largest batch whose cache at ``T`` rows (ledger, physical bytes) plus the weights fits
  ``--hbm-gb``; checked by allocating that cache for real and comparing its ``nbytes`` (``--check-capacity``).
* **prefill**: B = 1, ``--prefill-T`` prompt tokens through ``serving.generate.prefill_chunked`` (chunk
  ``--chunk``, cuDNN flash attention on GPU) against a plain full-precision cuDNN ``dot_product_attention``
  causal forward of the same model with no cache, tokens/s of each in the same run.

Writes ``serving.json`` and ``serving.md`` under ``--out`` (and ``$OUT`` on the device machine) with the command,
device, JAX version and date.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import itertools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvquant_jax import sharding as S  # noqa: E402
from kvquant_jax.cache import ops  # noqa: E402
from kvquant_jax.cache.interface import init_cache  # noqa: E402
from kvquant_jax.cache.registry import make_scheme  # noqa: E402
from kvquant_jax.models.config import LlamaConfig  # noqa: E402
from kvquant_jax.models.fixed_order import NUMERICS, apply_numerics  # noqa: E402
from kvquant_jax.models.llama import (decoder_layer, logits_from_hidden, stack_layers,  # noqa: E402
                                      unstack_layers)
from kvquant_jax.quant.ledger import Ledger, LedgerShape, ledger  # noqa: E402
from kvquant_jax.serving.generate import decode_loop, prefill_chunked  # noqa: E402
from kvquant_jax.serving.sampling import SamplingParams  # noqa: E402
from experiments.timing import copy_tbps, median_seconds, read_tbps  # noqa: E402

GiB = 1 << 30


def llama3_8b_shaped() -> LlamaConfig:
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                       num_kv_heads=8, head_dim=128, rope_theta=500000.0, rope_pairing="half_split", rms_eps=1e-5,
                       max_position=131072, tie_embeddings=True, bos_id=1, eos_id=2, name="llama3-8b-shaped")


def tiny() -> LlamaConfig:
    return LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=32, rope_theta=10000.0, rope_pairing="half_split", rms_eps=1e-5,
                       max_position=8192, tie_embeddings=True, bos_id=1, eos_id=2, name="tiny-bench")


def random_params(cfg: LlamaConfig, dtype=jnp.bfloat16, seed: int = 0) -> dict:
    """Unstacked random weights generated on the device layer by layer (an 8B model never exists on the host)."""
    key = jax.random.PRNGKey(seed)
    h, f, qd, kd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    @jax.jit
    def layer(k):
        ks = jax.random.split(k, 7)
        w = lambda kk, shape: (jax.random.normal(kk, shape, jnp.float32) / np.sqrt(shape[0])).astype(dtype)
        return {"attn_norm": jnp.ones((h,), jnp.float32), "ffn_norm": jnp.ones((h,), jnp.float32),
                "wq": w(ks[0], (h, qd)), "wk": w(ks[1], (h, kd)), "wv": w(ks[2], (h, kd)), "wo": w(ks[3], (qd, h)),
                "w_gate": w(ks[4], (h, f)), "w_up": w(ks[5], (h, f)), "w_down": w(ks[6], (f, h))}

    layers = tuple(layer(jax.random.fold_in(key, i)) for i in range(cfg.num_layers))
    embed = (jax.random.normal(jax.random.fold_in(key, 10_000), (cfg.vocab_size, h), jnp.float32) * 0.02).astype(dtype)
    return {"embed": embed, "final_norm": jnp.ones((h,), jnp.float32), "layers": layers}


def load_smollm2(dtype: str):
    from kvquant_jax.models import load_model
    from kvquant_jax.models.llama import cast_params

    m = load_model()
    return m.cfg, unstack_layers(cast_params(jax.device_get(m.params), dtype))


def tree_bytes(tree) -> int:
    return int(sum(a.nbytes for a in jax.tree.leaves(tree)))


def filled_cache(cfg, scheme, batch: int, length: int, capacity: int, layer_groups: str, chunk: int = 2048):
    """A cache holding ``length`` random rows per sequence, appended chunk by chunk through ``ops.try_append``.
    Under ``sharding.mesh_context`` (``--mesh``) the cache is laid out on the mesh and stays there."""
    cache = S.on_current_mesh(init_cache(scheme, num_layers=cfg.num_layers, batch=batch, capacity=capacity,
                                         num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                         layer_groups=layer_groups))

    @functools.partial(jax.jit, donate_argnums=0)
    def fill(cache, key, n):
        k = jax.random.normal(key, (batch, chunk, cfg.num_kv_heads, cfg.head_dim), jnp.float32).astype(jnp.bfloat16)
        v = jax.random.normal(jax.random.fold_in(key, 1), k.shape, jnp.float32).astype(jnp.bfloat16)
        cache, ok = ops.try_append(cache, [(k, v)] * cfg.num_layers, n)
        return S.constrain_cache(cache), ok

    done = 0
    while done < length:
        n = min(chunk, length - done)
        cache, ok = fill(cache, jax.random.PRNGKey(done), jnp.full((batch,), n, jnp.int32))
        if not bool(ok):
            raise RuntimeError(f"filling the {scheme.schema.payload} cache was rejected at row {done}")
        done += n
    jax.block_until_ready(cache)
    return cache


def weight_bytes_per_step(params) -> int:
    """Bytes a decode step reads of the weights: every layer weight, the final norm and the (tied) head."""
    return tree_bytes(params["layers"]) + tree_bytes(params["final_norm"]) + tree_bytes(params["embed"])


def time_decode(params, cfg, cache, steps: int, reps: int, impl: str):
    greedy = SamplingParams(temperature=0.0)
    b = cache.batch
    first = jnp.zeros((b,), jnp.int32)
    key = jax.random.PRNGKey(0)
    t0 = time.perf_counter()
    out = decode_loop(params, cfg, first, cache, key, max_new=steps + 1, sampling=greedy, eos_id=-1,
                      attention_impl=impl)
    jax.block_until_ready(out)
    compile_and_first = time.perf_counter() - t0
    cache, ok = out[2], out[3]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = decode_loop(params, cfg, first, cache, key, max_new=steps + 1, sampling=greedy, eos_id=-1,
                          attention_impl=impl)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / steps)
        cache, ok = out[2], out[3] & ok
    if not bool(ok):
        raise RuntimeError("a decode step was rejected")
    return times, compile_and_first, out[0]


def decode_rows(args, cfg, params_u, params_s, tbps, rows, log):
    for t in args.T:
        for spec in args.cache:
            scheme = make_scheme(spec, rope_theta=cfg.rope_theta, rope_pairing=cfg.rope_pairing)
            for b in args.batch:
                cap = t + (args.reps + 2) * args.steps + 64
                cap = -(-cap // 256) * 256
                lg = ledger(scheme, LedgerShape(cfg.num_layers, b, cfg.num_kv_heads, cfg.head_dim, t, cap))
                kv_read = Ledger.total(lg.read_per_step)
                for layout, impl, mesh_name, reduction in itertools.product(args.layout, args.impl, args.mesh,
                                                                            args.reduction):
                    if layout == "stacked" and params_s is None:
                        continue
                    rcfg = apply_numerics(cfg, reduction)
                    mesh = None if mesh_name == "none" else S.make_mesh(mesh_name)
                    params = params_u if layout == "serving" else params_s
                    groups = "per_layer" if layout == "serving" else "runs"
                    try:
                        with S.mesh_context(mesh):
                            params = S.params_on_current_mesh(params, cfg)
                            cache = filled_cache(cfg, scheme, b, t, cap, groups)
                            times, first_s, toks = time_decode(params, rcfg, cache, args.steps, args.reps, impl)
                        del cache, params
                    except Exception as e:  # noqa: BLE001 - a benchmark row records its failure
                        log(f"decode {spec} B={b} T={t} {layout}/{impl} mesh {mesh_name}: FAILED "
                            f"{type(e).__name__}: {e}"[:400])
                        rows.append(dict(kind="decode", cache=spec, B=b, T=t, layout=layout, impl=impl,
                                         mesh=mesh_name, reduction=reduction,
                                         error=f"{type(e).__name__}: {e}"[:400]))
                        gc.collect()
                        continue
                    gc.collect()
                    params = params_u if layout == "serving" else params_s
                    w = weight_bytes_per_step(params)
                    roof_ms = (w + kv_read) / (tbps * 1e12) * 1e3
                    ms = statistics.median(times) * 1e3
                    row = dict(kind="decode", cache=spec, B=b, T=t, layout=layout, impl=impl, mesh=mesh_name,
                               reduction=reduction, ms_per_step=ms, ms_runs=[x * 1e3 for x in times],
                               tokens_per_s=b / (ms / 1e3),
                               weights_gb=w / 1e9, kv_read_gb=kv_read / 1e9,
                               cache_gb=Ledger.total(lg.physical) / 1e9, roofline_ms=roof_ms,
                               frac_of_roofline=roof_ms / ms, compile_and_first_s=first_s,
                               tokens_head=np.asarray(toks)[0, :8].tolist())
                    key = (spec, b, t, layout, impl)
                    ok = [r for r in rows if r.get("kind") == "decode" and "error" not in r and
                          (r["cache"], r["B"], r["T"], r["layout"], r["impl"]) == key]
                    base = [r for r in ok if r["mesh"] == "none" and r["reduction"] == reduction]
                    if mesh_name != "none" and base:   # the sharded code path's cost vs the plain one
                        row["vs_unsharded"] = ms / base[-1]["ms_per_step"]
                    fast = [r for r in ok if r["mesh"] == mesh_name and r["reduction"] == "fast"]
                    if reduction != "fast" and fast:   # the fixed-order numerics' cost vs the default
                        row["vs_fast"] = ms / fast[-1]["ms_per_step"]
                    rows.append(row)
                    vs = f"  {100 * (row['vs_unsharded'] - 1):+5.1f}% vs unsharded" if "vs_unsharded" in row else ""
                    vs += f"  {row['vs_fast']:.2f}x vs fast" if "vs_fast" in row else ""
                    log(f"decode {spec:8s} B={b} T={t} {layout:8s} {impl:9s} {reduction:11s} mesh {mesh_name:14s} "
                        f"{ms:8.2f} "
                        f"ms/step  roofline {roof_ms:6.2f} ms ({100 * roof_ms / ms:5.1f}%)  compile+first "
                        f"{first_s:6.1f} s{vs}")


def capacity_rows(args, cfg, params_u, rows, log):
    w = tree_bytes(params_u)
    budget = int(args.hbm_gb * 1e9)
    for t in args.capacity_T:
        for spec in args.cache:
            scheme = make_scheme(spec, rope_theta=cfg.rope_theta, rope_pairing=cfg.rope_pairing)
            one = Ledger.total(ledger(scheme, LedgerShape(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, t,
                                                            t)).physical)
            b = max(0, (budget - w) // one)
            while b > 0 and Ledger.total(ledger(scheme, LedgerShape(cfg.num_layers, int(b), cfg.num_kv_heads,
                                                                    cfg.head_dim, t, t)).physical) + w > budget:
                b -= 1
            b = int(b)
            row = dict(kind="capacity", cache=spec, T=t, hbm_gb=args.hbm_gb, weights_gb=w / 1e9, max_batch=b,
                       per_seq_gb=one / 1e9)
            if args.check_capacity and b > 0:
                try:
                    cache = init_cache(scheme, num_layers=cfg.num_layers, batch=b, capacity=t,
                                       num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, layer_groups="per_layer")
                    jax.block_until_ready(cache)
                    real = tree_bytes(cache.groups) + int(cache.lengths.nbytes)
                    lg = Ledger.total(ledger(scheme, LedgerShape(cfg.num_layers, b, cfg.num_kv_heads, cfg.head_dim,
                                                                 t, t)).physical)
                    row.update(allocated_gb=real / 1e9, ledger_gb=lg / 1e9, ledger_equals_allocation=real == lg)
                    del cache
                except Exception as e:  # noqa: BLE001 - e.g. the allocator's pool (XLA_PYTHON_CLIENT_MEM_FRACTION)
                    row.update(allocation_error=f"{type(e).__name__}: {e}"[:300])
                gc.collect()
            rows.append(row)
            log(f"capacity {spec:8s} T={t}: max batch {b} within {args.hbm_gb} GB "
                f"({row.get('allocated_gb', float('nan')):.1f} GB allocated, ledger equal: "
                f"{row.get('ledger_equals_allocation')})")


def plain_prefill_fn(cfg):
    """Full-precision causal forward with cuDNN flash attention and no cache: the prefill speed reference."""

    def attn(q, k, v):
        impl = "cudnn" if jax.default_backend() == "gpu" else None
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)

    @jax.jit
    def run(params, tokens):
        b, t = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        x = params["embed"][tokens]
        for lp in params["layers"]:
            x, _, _ = decoder_layer(cfg, x, lp, pos, attn)
        return logits_from_hidden(params, cfg, x[:, -1:])

    return run


def prefill_rows(args, cfg, params_u, rows, log):
    scheme = make_scheme("bf16", rope_theta=cfg.rope_theta, rope_pairing=cfg.rope_pairing)
    plain = plain_prefill_fn(cfg)
    for t in args.prefill_T:
        tokens = jax.random.randint(jax.random.PRNGKey(t), (1, t), 0, cfg.vocab_size, jnp.int32)
        row = dict(kind="prefill", cache="bf16", B=1, T=t, chunk=args.chunk)
        try:
            row["plain_cudnn_s"] = median_seconds(plain, params_u, tokens, reps=args.reps)
            row["plain_tokens_per_s"] = t / row["plain_cudnn_s"]
        except Exception as e:  # noqa: BLE001
            row["plain_error"] = f"{type(e).__name__}: {e}"[:300]
        try:
            ts = []
            for r in range(args.reps + 1):
                cache = init_cache(scheme, num_layers=cfg.num_layers, batch=1, capacity=t + 64,
                                   num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, layer_groups="per_layer")
                t0 = time.perf_counter()
                last, cache, ok = prefill_chunked(params_u, cfg, tokens, cache, np.array([t], np.int32),
                                                  chunk=args.chunk)
                jax.block_until_ready((last, cache))
                if r:
                    ts.append(time.perf_counter() - t0)
                del cache
            row["ours_s"] = statistics.median(ts)
            row["ours_tokens_per_s"] = t / row["ours_s"]
            if "plain_cudnn_s" in row:
                row["ours_vs_plain"] = row["plain_cudnn_s"] / row["ours_s"]
        except Exception as e:  # noqa: BLE001
            row["ours_error"] = f"{type(e).__name__}: {e}"[:300]
        gc.collect()
        rows.append(row)
        log(f"prefill T={t}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in row.items() if k not in ("kind",)))


def markdown(meta, rows) -> str:
    out = [f"# Serving benchmark ({meta['model']}, {meta['device']}, JAX {meta['jax']}, {meta['date']})", "",
           f"Command: `{meta['command']}`", "", f"Copy bandwidth in this run: {meta['copy_tbps']:.2f} TB/s (read-only sum: {meta.get('read_tbps', float('nan')):.2f} "
           "TB/s; the roofline divides by the copy figure)", ""]
    dec = [r for r in rows if r["kind"] == "decode"]
    if dec:
        out += ["| cache | B | T | layout | attention | numerics | mesh | ms/step | runs | tok/s | cache GB | "
                "KV read GB | roofline ms | % of roofline | compile+first s | vs unsharded | vs fast |",
                "|" + "---|" * 17]
        for r in dec:
            mesh = r.get("mesh", "none")
            red = r.get("reduction", "fast")
            if "error" in r:
                out.append(f"| {r['cache']} | {r['B']} | {r['T']} | {r['layout']} | {r['impl']} | {red} | {mesh} | "
                           f"failed: {r['error'][:80]} | | | | | | | | | |")
                continue
            vs = f"{r['vs_unsharded']:.3f}x" if "vs_unsharded" in r else "-"
            vs += f" | {r['vs_fast']:.2f}x" if "vs_fast" in r else " | -"
            out.append(f"| {r['cache']} | {r['B']} | {r['T']} | {r['layout']} | {r['impl']} | {red} | {mesh} | "
                       f"{r['ms_per_step']:.2f} "
                       f"| {' / '.join(f'{x:.2f}' for x in r['ms_runs'])} | {r['tokens_per_s']:.0f} | "
                       f"{r['cache_gb']:.2f} | {r['kv_read_gb']:.2f} | {r['roofline_ms']:.2f} | "
                       f"{100 * r['frac_of_roofline']:.0f}% | {r['compile_and_first_s']:.1f} | {vs} |")
        out.append("")
    cap = [r for r in rows if r["kind"] == "capacity"]
    if cap:
        out += ["| cache | T | HBM budget GB | max batch | per-sequence GB | allocated GB | ledger == allocation |",
                "|---|---|---|---|---|---|---|"]
        for r in cap:
            out.append(f"| {r['cache']} | {r['T']} | {r['hbm_gb']} | {r['max_batch']} | {r['per_seq_gb']:.3f} | "
                       f"{r.get('allocated_gb', float('nan')):.1f} | {r.get('ledger_equals_allocation', '-')} |")
        out.append("")
    pre = [r for r in rows if r["kind"] == "prefill"]
    if pre:
        out += ["| prefill T (B = 1) | chunk | ours s | ours tok/s | plain cuDNN s | plain tok/s | ours / plain |",
                "|---|---|---|---|---|---|---|"]
        for r in pre:
            f = lambda k: f"{r[k]:.4g}" if k in r else "-"   # noqa: E731 - a missing figure: see the error below
            out.append(f"| {r['T']} | {r['chunk']} | {f('ours_s')} | {f('ours_tokens_per_s')} | {f('plain_cudnn_s')} | "
                       f"{f('plain_tokens_per_s')} | {f('ours_vs_plain')} |")
        out += [f"\nprefill T={r['T']}: {k} {r[k]}" for r in pre for k in ("ours_error", "plain_error") if k in r]
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3-8b-shaped", choices=["llama3-8b-shaped", "smollm2", "tiny"])
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--cache", nargs="+", default=["bf16", "int8", "int4", "int2", "kivi2"])
    ap.add_argument("--batch", type=int, nargs="+", default=[8])
    ap.add_argument("--T", type=int, nargs="*", default=[32768])
    ap.add_argument("--layout", nargs="+", default=["serving"], choices=["serving", "stacked"])
    ap.add_argument("--impl", nargs="+", default=["auto"], choices=["auto", "reference", "kernel"])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--capacity-T", type=int, nargs="*", default=[])
    ap.add_argument("--hbm-gb", type=float, default=120.0)
    ap.add_argument("--check-capacity", action="store_true")
    ap.add_argument("--prefill-T", type=int, nargs="*", default=[])
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--mesh", nargs="+", default=["none"],
                    help="decode rows per device mesh: 'none' (the plain path) and/or 'data=D,model=M' (the sharded "
                         "path, kvquant_jax.sharding); 'none data=1,model=1' measures the 1x1 overhead")
    ap.add_argument("--reduction", nargs="+", default=["fast"], choices=list(NUMERICS),
                    help="decode rows per projection numerics (kvquant_jax/models/fixed_order.py): 'fast' and/or "
                         "'fixed_order' (its rows add vs_fast; it always runs the float32 reference attention)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for m in args.mesh:
        if m != "none":
            try:
                S.parse_mesh(m)
            except ValueError as e:
                ap.error(f"--mesh: {e}")
    for name in ("steps", "reps", "chunk"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if any(x < 1 for x in args.batch + args.T + args.capacity_T + args.prefill_T):
        ap.error("batch sizes and lengths must be >= 1")

    dev = jax.devices()[0]
    meta = dict(command="python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
                device=getattr(dev, "device_kind", str(dev)), backend=jax.default_backend(), jax=jax.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"), model=args.model)
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    meta["copy_tbps"] = copy_tbps()
    meta["read_tbps"] = read_tbps()
    log(f"{meta['device']} JAX {meta['jax']}: copy {meta['copy_tbps']:.2f} TB/s, read {meta['read_tbps']:.2f} TB/s")
    if args.model == "smollm2":
        cfg, params_u = load_smollm2(args.dtype)
    else:
        cfg = llama3_8b_shaped() if args.model == "llama3-8b-shaped" else tiny()
        params_u = random_params(cfg, {"bf16": jnp.bfloat16, "fp32": jnp.float32}[args.dtype])
    log(f"weights {tree_bytes(params_u) / 1e9:.2f} GB")
    rows: list = []
    # --out, else the device machine's $OUT (never both: two runs in one call must not overwrite each other)
    out_dirs = [d for d in [args.out or os.environ.get("OUT")] if d]

    def flush():
        for d in out_dirs:
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "serving.json"), "w") as f:
                json.dump(dict(meta=meta, rows=rows, log=lines), f, indent=1)

    params_s = stack_layers(params_u) if "stacked" in args.layout else None
    decode_rows(args, cfg, params_u, params_s, meta["copy_tbps"], rows, log)
    flush()
    del params_s
    gc.collect()
    capacity_rows(args, cfg, params_u, rows, log)
    flush()
    prefill_rows(args, cfg, params_u, rows, log)
    flush()
    md = markdown(meta, rows)
    print(md)
    for d in out_dirs:
        with open(os.path.join(d, "serving.md"), "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
