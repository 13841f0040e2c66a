"""GPU check of Gemma-3-270M decode through the dispatcher (MQA 4:1, head_dim 256, window starts).

Prefill ``--prefill`` tokens, then decode ``--decode`` tokens one at a time with ``attention_impl="kernel"`` (local
layers: the window ring's regions, block 0 read in place; global layers: the scheme's kernel) and with the float32
reference; reports max |Δlogit| / max|logit| per cache scheme against ``forward_nocache`` of the same tokens.

    python experiments/check_gemma3_gpu.py --prefill 600 --decode 100 --cache fp32 bf16 int8 int4 kivi2
    # CPU smoke run (kernels interpreted): --prefill 20 --decode 2 --cache fp32
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kvquant_jax.cache.registry import make_scheme  # noqa: E402
from kvquant_jax.data import load_corpus  # noqa: E402
from kvquant_jax.models import load_model  # noqa: E402
from kvquant_jax.models.cache_layout import init_model_cache  # noqa: E402
from kvquant_jax.models.llama import forward, forward_nocache  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, default=600)
    ap.add_argument("--decode", type=int, default=100)
    ap.add_argument("--cache", nargs="+", default=["fp32", "bf16", "int8", "int4", "kivi2"])
    ap.add_argument("--dtype", default="fp32")
    a = ap.parse_args()
    m = load_model("gemma3-270m", dtype=a.dtype)
    cfg, params = m.cfg, m.params
    ids = m.tokenizer.encode(load_corpus(None, split="test").text)[: a.prefill + a.decode - 1]
    toks = np.asarray([[cfg.bos_id] + ids], np.int32)
    full = np.asarray(jax.jit(forward_nocache, static_argnums=1)(params, cfg, jnp.asarray(toks)))[0]
    step = jax.jit(forward, static_argnums=(1,), static_argnames=("attention_impl",))
    out = {"device": str(jax.devices()[0]), "prefill": a.prefill, "decode": a.decode, "rows": []}
    for spec in a.cache:
        row = {"cache": spec}
        for impl in ("kernel", "reference"):
            cache = init_model_cache(cfg, make_scheme(spec), batch=1, capacity=a.prefill + a.decode + 16)
            lg, cache, ok = step(params, cfg, jnp.asarray(toks[:, :a.prefill]), cache, None, attention_impl=impl)
            errs = []
            for p in range(a.prefill, a.prefill + a.decode):
                lg, cache, ok = step(params, cfg, jnp.asarray(toks[:, p:p + 1]), cache, None, attention_impl=impl)
                errs.append(float(np.abs(np.asarray(lg)[0, 0] - full[p]).max() / np.abs(full).max()))
            row[impl] = max(errs)
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
