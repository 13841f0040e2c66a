"""transformers fp32 reference figures for Gemma-3-270M on the same GGUF (CPU): the numbers the Gemma tests pin.

Writes JSON to ``--out`` (default docs/results/gemma3/transformers_reference.json): the config transformers builds
from the GGUF, perplexity under the BOS protocol (``--segments`` segments of [BOS] + 1023 WikiText-2 test tokens,
text tokenized once without special tokens, mean NLL over the 1023 text predictions), the greedy continuation of
"The capital of France is" (20 tokens, BOS + prompt), and the token count of the whole test split.

    python experiments/gemma3_transformers_reference.py --gguf $KVQ_CACHE_DIR/gemma-3-270m-q4_k_m.gguf \
        --corpus ../shared/data/wikitext2/wiki.test.raw
"""
import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import transformers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--out", default="docs/results/gemma3/transformers_reference.json")
    a = ap.parse_args()
    torch.set_num_threads(2)
    p = Path(a.gguf)
    t0 = time.time()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    model.eval()
    out = {"transformers": transformers.__version__, "torch": torch.__version__, "gguf": p.name,
           "config": json.loads(model.config.to_json_string()), "load_s": time.time() - t0}
    text = Path(a.corpus).read_text(encoding="utf-8")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out["test_tokens"] = len(ids)
    bos = model.config.bos_token_id
    n = a.seq_len - 1
    nlls = []
    with torch.no_grad():
        for s in range(a.segments):
            seg = [bos] + ids[s * n:(s + 1) * n]
            logits = model(torch.tensor([seg])).logits[0].double()
            lp = torch.log_softmax(logits[:-1], -1)
            tgt = torch.tensor(seg[1:])
            nll = -lp[torch.arange(len(tgt)), tgt]
            nlls.append(nll[:].numpy())            # predictions of the 1023 text tokens
            print(f"segment {s}: mean nll {nll.mean().item():.4f}", flush=True)
        nll_all = np.concatenate(nlls)
        out["ppl_bos_protocol"] = {"segments": a.segments, "seq_len": a.seq_len, "bos": True,
                                   "segment_nll": [float(x.mean()) for x in nlls],
                                   "tokens": int(nll_all.size), "mean_nll": float(nll_all.mean()),
                                   "ppl": float(math.exp(nll_all.mean()))}
        prompt = [bos] + tok("The capital of France is", add_special_tokens=False)["input_ids"]
        g = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)
        new = g[0, len(prompt):].tolist()
        out["greedy"] = {"prompt_ids": prompt, "new_ids": new, "text": tok.decode(new)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(json.dumps({k: out[k] for k in ("ppl_bos_protocol", "greedy", "test_tokens")}, indent=1))


if __name__ == "__main__":
    main()
