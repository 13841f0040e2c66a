"""On-device checks of the serving path (run on the GPU; also runs on CPU with the reference paths).

    python experiments/check_serving_gpu.py [--out DIR]

1. ``prefill_attention_cudnn`` vs the float32 reference ``attend`` on random ragged batches (history + causal
   chunk, GQA 4:1 and 3:1, D 64 / 128): relative error (bf16 operands, so ~1e-2 is expected, not 1e-6).
2. A tiny random model: chunked prefill (cuDNN, chunk 64) vs one-shot reference prefill: logits relative error;
   and greedy tokens of the kernel path vs the reference path for 32 steps (bf16, int4, kivi2 caches).
3. The compiled decode step (serving layout: unstacked params, one cache group per layer): the number of HLO
   ``copy`` instructions whose shape is a cache buffer's, and of large dynamic-slice / copy fusions (a per-layer
   copy of weights or cache would show here), against the stacked layout under ``lax.scan``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvquant_jax.cache.interface import init_cache  # noqa: E402
from kvquant_jax.cache.registry import make_scheme  # noqa: E402
from kvquant_jax.models.llama import forward, stack_layers, unstack_layers  # noqa: E402
from kvquant_jax.models.prefill_attention import attend, prefill_attention_cudnn  # noqa: E402
from kvquant_jax.models.testing import random_params, tiny_config  # noqa: E402
from kvquant_jax.serving.generate import generate, prefill_chunked  # noqa: E402


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def check_attention(out):
    rng = np.random.default_rng(0)
    res = []
    for (b, t, hq, hkv, d, c) in [(3, 64, 8, 2, 64, 200), (2, 128, 9, 3, 64, 300), (2, 256, 32, 8, 128, 1024)]:
        q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
        k = rng.standard_normal((b, t, hkv, d)).astype(np.float32)
        v = rng.standard_normal((b, t, hkv, d)).astype(np.float32)
        hk = rng.standard_normal((b, hkv, c, d)).astype(np.float32)
        hv = rng.standard_normal((b, hkv, c, d)).astype(np.float32)
        n_hist = np.array([0] + list(rng.integers(1, c, b - 1)), np.int32)
        valid = np.arange(c)[None] < n_hist[:, None]
        num_new = np.array([t] + list(rng.integers(1, t, b - 1)), np.int32)
        args = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)]
        hist = (jnp.asarray(hk, jnp.bfloat16), jnp.asarray(hv, jnp.bfloat16), jnp.asarray(valid))
        ref = attend(*[a.astype(jnp.float32) for a in args], jnp.asarray(num_new),
                     tuple(h.astype(jnp.float32) if h.dtype != jnp.bool_ else h for h in hist))
        got = jax.jit(prefill_attention_cudnn)(*args, jnp.asarray(num_new), hist)
        m = (np.arange(t)[None] < num_new[:, None])[:, :, None, None]
        e = rel(np.where(m, np.asarray(got, np.float32), 0), np.where(m, np.asarray(ref), 0))
        res.append(dict(shape=[b, t, hq, hkv, d, c], rel_err=e))
        print(f"cudnn prefill attention {b, t, hq, hkv, d, c}: rel err {e:.2e}", flush=True)
    out["attention"] = res


def check_model(out):
    cfg = tiny_config(num_layers=3, head_dim=64, num_heads=8, num_kv_heads=2, hidden_size=128, intermediate_size=256,
                      max_position=2048)
    params = random_params(cfg, dtype="bf16")
    rng = np.random.default_rng(1)
    toks = rng.integers(0, cfg.vocab_size, (2, 256)).astype(np.int32)
    scheme = make_scheme("bf16", rope_theta=cfg.rope_theta, rope_pairing=cfg.rope_pairing)

    def cache():
        return init_cache(scheme, num_layers=cfg.num_layers, batch=2, capacity=320, num_kv_heads=cfg.num_kv_heads,
                          head_dim=cfg.head_dim)

    ref_logits, _, _ = jax.jit(lambda p, t, c: forward(p, cfg, t, c, attention_impl="reference"))(
        params, jnp.asarray(toks), cache())
    last, _, ok = prefill_chunked(unstack_layers(params), cfg, toks, cache(), np.array([256, 256], np.int32),
                                  chunk=64)
    e = rel(np.asarray(last), np.asarray(ref_logits)[:, -1])
    out["chunked_prefill_vs_oneshot_reference_rel"] = e
    print(f"tiny model chunked cuDNN prefill vs one-shot reference: last-logit rel err {e:.2e}", flush=True)
    greedy = {}
    prompts = [toks[0, :40].tolist(), toks[1, :23].tolist()]
    for spec in ("bf16", "int4", "kivi2"):
        sc = make_scheme(spec, rope_theta=cfg.rope_theta, rope_pairing=cfg.rope_pairing)
        a = generate(params, cfg, prompts, max_new_tokens=32, scheme=sc, eos_id=-1, attention_impl="reference",
                     layer_groups="runs")
        b = generate(unstack_layers(params), cfg, prompts, max_new_tokens=32, scheme=sc, eos_id=-1,
                     attention_impl="auto")
        same = [x == y for x, y in zip(a.tokens, b.tokens)]
        first_diff = [next((i for i, (u, w) in enumerate(zip(x, y)) if u != w), None) for x, y in zip(a.tokens, b.tokens)]
        greedy[spec] = dict(equal=all(same), first_diff=first_diff)
        print(f"greedy 32 tokens {spec}: kernel path == reference path: {same} (first diff {first_diff})", flush=True)
    out["greedy"] = greedy


def check_hlo(out):
    """Compiled decode step (kernel path) per layout: cache-typed HLO copies and input->output aliases."""
    from kvquant_jax.serving.inspect import aliased_parameters, cache_buffer_copies

    cfg = tiny_config(num_layers=4, head_dim=64, num_heads=8, num_kv_heads=2, hidden_size=128, intermediate_size=256)
    params = random_params(cfg, dtype="bf16")
    res = {}
    for spec in ("bf16", "int4", "kivi2"):
        sc = make_scheme(spec, rope_theta=cfg.rope_theta, rope_pairing=cfg.rope_pairing)
        for layout in ("serving", "stacked"):
            p = unstack_layers(params) if layout == "serving" else stack_layers(params)
            c = init_cache(sc, num_layers=cfg.num_layers, batch=2, capacity=512, num_kv_heads=cfg.num_kv_heads,
                           head_dim=cfg.head_dim, layer_groups="per_layer" if layout == "serving" else "runs")
            f = jax.jit(lambda p, t, c: forward(p, cfg, t, c, attention_impl="auto"), donate_argnums=2)
            hlo = f.lower(p, jnp.zeros((2, 1), jnp.int32), c).compile().as_text()
            copies = cache_buffer_copies(hlo, c)
            res[f"{spec}/{layout}"] = dict(cache_copies=sorted({f"{f_}:{s_}" for f_, s_ in copies}),
                                           n_cache_copies=len(copies), aliases=aliased_parameters(hlo),
                                           cache_buffers=len(jax.tree.leaves(c.groups)),
                                           dynamic_slices=len(re.findall(r"dynamic-slice", hlo)))
            print(f"HLO decode step {spec}/{layout}: {res[f'{spec}/{layout}']}", flush=True)
    out["hlo"] = res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = dict(device=str(jax.devices()[0]), jax=jax.__version__)
    for fn in (check_attention, check_model, check_hlo):
        if fn is check_attention and jax.default_backend() != "gpu":
            print("cuDNN attention check skipped (no GPU)")
            continue
        try:
            fn(out)
        except Exception as e:  # noqa: BLE001 - report every check
            out[fn.__name__] = f"FAILED {type(e).__name__}: {e}"[:500]
            print(out[fn.__name__], flush=True)
    for d in filter(None, [args.out, os.environ.get("OUT")]):
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "check_serving.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
