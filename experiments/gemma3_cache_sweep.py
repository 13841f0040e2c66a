"""CPU-sized KV-cache sweep on Gemma-3-270M: perplexity through the cache (BOS protocol, chunked fast path) and the
bytes each policy keeps at 32K tokens, for int / KIVI / FP8 and mixed-by-layer-type policies.

Every segment is ``[BOS] + seq_len - 1`` WikiText-2 test tokens (the documented protocol for models that need BOS),
fed through a fresh cache in ``--chunk``-token forwards (``eval.quantized_ppl.chunked_nll``: a query reads its own
chunk exactly and every earlier chunk from the stored representation); local layers keep their 512-row window ring
of the policy's scheme (``models.cache_layout.layer_schemes``).  Bytes: the ledger's logical view at 32,768 tokens,
B = 1, over the real per-layer schemes (window rings included), next to a full-length bf16 cache.

    python experiments/gemma3_cache_sweep.py --segments 2 --seq-len 1024 --chunk 256 --out docs/results/gemma3/sweep
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kvquant_jax.cache.registry import make_scheme  # noqa: E402
from kvquant_jax.data import load_corpus  # noqa: E402
from kvquant_jax.eval.ppl import segments  # noqa: E402
from kvquant_jax.eval.quantized_ppl import chunked_nll  # noqa: E402
from kvquant_jax.models import load_model  # noqa: E402
from kvquant_jax.models.cache_layout import layer_schemes, schemes_by_layer_type  # noqa: E402
from kvquant_jax.quant.ledger import Ledger, LedgerShape, ledger  # noqa: E402

#: name -> (spec of local layers, spec of global layers)
POLICIES = {
    "fp32": ("fp32", "fp32"),
    "bf16": ("bf16", "bf16"),
    "fp8_e4m3 (warm-up per-head scales)": ("fp8_e4m3:scales=warmup,axis=head", "fp8_e4m3:scales=warmup,axis=head"),
    "int8": ("int8", "int8"),
    "int4": ("int4", "int4"),
    "int4 g32": ("int4:group_size=32", "int4:group_size=32"),
    "kivi4": ("kivi4", "kivi4"),
    "kivi2": ("kivi2", "kivi2"),
    "local bf16 + global kivi2": ("bf16", "kivi2"),
    "local kivi2 + global bf16": ("kivi2", "bf16"),
    "local int4 + global bf16": ("int4", "bf16"),
    "local bf16 + global int4": ("bf16", "int4"),
}


def policy(cfg, name):
    return schemes_by_layer_type(cfg, *POLICIES[name])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--segments", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--corpus", default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    m = load_model("gemma3-270m")
    cfg = m.cfg
    corpus = load_corpus(a.corpus, split="test")
    segs = segments(m.tokenizer.encode(corpus.text), a.seq_len, a.segments, bos_id=cfg.bos_id)
    t32 = 32768
    shape = LedgerShape(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, t32, t32)
    full_bf16 = Ledger.total(ledger((make_scheme("bf16"),) * cfg.num_layers, shape).logical)
    rows, base = [], None
    for name in a.policies:
        per = policy(cfg, name)
        t0 = time.time()
        nll = [float(np.asarray(chunked_nll(m.params, cfg, jnp.asarray(s[None]), per, a.chunk), np.float64).mean())
               for s in segs]
        ppl = math.exp(float(np.mean(nll)))
        base = ppl if base is None else base
        kept = Ledger.total(ledger(layer_schemes(cfg, per, capacity=t32), shape).logical)
        row = {"policy": name, "ppl": ppl, "delta_vs_first": ppl - base, "segment_nll": nll, "bytes_32k": kept,
               "vs_full_length_bf16": kept / full_bf16, "seconds": time.time() - t0}
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    meta = {"model": m.path, "model_sha256": cfg.sha256, "corpus": corpus.name, "corpus_sha256": corpus.sha256,
            "segments": a.segments, "seq_len": a.seq_len, "chunk": a.chunk, "bos": True}
    (Path(a.out) / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"| policy | ppl | Δ vs {rows[0]['policy']} | KV bytes at 32K (B = 1) | vs full-length bf16 |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['policy']} | {r['ppl']:.3f} | {r['delta_vs_first']:+.3f} | {r['bytes_32k']:,} | "
              f"{r['vs_full_length_bf16']:.3f} |" for r in rows]
    (Path(a.out) / "README.md").write_text(
        f"# Gemma-3-270M cache sweep ({a.segments} x ([BOS] + {a.seq_len - 1}) WikiText-2 test tokens, chunk "
        f"{a.chunk})\n\n```bash\npython experiments/gemma3_cache_sweep.py --segments {a.segments} --seq-len "
        f"{a.seq_len} --chunk {a.chunk} --out {a.out}\n```\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
