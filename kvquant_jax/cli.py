"""``kvq`` command line: fetch-model, generate, ppl, ledger, calibrate, eval, sweep, tune-policy, serve-bench."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from kvquant_jax import validation as checks


def _add_model_args(p):
    p.add_argument("--model", default=None,
                   help="known model name (smollm2-135m (default) or gemma3-270m, fetched on first use), a .gguf "
                        "file or a HF folder")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="compute/weight dtype")
    p.add_argument("--rope-pairing", default="half_split", choices=["half_split", "interleaved"])
    p.add_argument("--w8a8", action="store_true",
                   help="W8A8 live activations (per-token INT8 x per-channel INT8 weights) in q/k/v/o/gate/up/down; "
                        "prefill W8A8, decode weight-only W8A16")
    p.add_argument("--reduction", default="fast", choices=["fast", "fixed_order"],
                   help="projection numerics: fast (one XLA dot each) or fixed_order (bit-identical results for "
                        "every --mesh and batch size, slower; kvquant_jax/models/fixed_order.py); not with --w8a8")
    p.add_argument("--smooth-alpha", type=float, default=None,
                   help="SmoothQuant migration strength (statistics from 8 x 512 WikiText-2 validation tokens)")


def _add_mesh_args(p):
    p.add_argument("--mesh", default=None,
                   help="device mesh 'data=D,model=M': sequences over D devices, heads / FFN / vocabulary over M "
                        "(CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    p.add_argument("--coordinator", default=None,
                   help="several hosts: HOST:PORT of process 0's coordinator (or $KVQ_COORDINATOR)")
    p.add_argument("--num-processes", type=int, default=None, help="several hosts: process count ($KVQ_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, default=None, help="several hosts: this process ($KVQ_PROCESS_ID)")


def _mesh(args):
    """Before anything touches JAX: ``jax.distributed`` when a coordinator is named, then the ``--mesh`` (None
    without one).  Bad values raise ``ValueError`` naming them."""
    from kvquant_jax import sharding as S

    shape = S.parse_mesh(args.mesh)
    S.distributed_args(args.coordinator, args.num_processes, args.process_id)      # checked before connecting
    S.initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    return None if shape is None else S.make_mesh(shape)


def _load(args):
    """load_model + the activation options (SmoothQuant fold, W8A8 weights and policy on cfg.activation)."""
    from kvquant_jax.models import load_model
    from kvquant_jax.models.fixed_order import apply_numerics

    m = load_model(args.model, dtype=args.dtype, rope_pairing=args.rope_pairing, verbose=True)
    params, cfg = m.params, m.cfg
    if args.smooth_alpha is not None:
        from kvquant_jax.calibration import smoothquant as SQ

        windows, rec = SQ.validation_windows(m.tokenizer, 8, 512)
        params = SQ.smooth_params(params, cfg, SQ.collect_stats(params, cfg, windows),
                                  SQ.SmoothQuantConfig(alpha=args.smooth_alpha))
        print(f"[kvq] SmoothQuant α={args.smooth_alpha} from {rec['name']} validation", file=sys.stderr)
    if args.w8a8:
        from kvquant_jax.models.w8a8 import W8A8Policy, apply_policy

        params, cfg = apply_policy(params, cfg, W8A8Policy())
    cfg = apply_numerics(cfg, getattr(args, "reduction", "fast"))
    return dataclasses.replace(m, params=params, cfg=cfg)


def _scheme(spec, cfg):
    if spec is None:
        return None
    from kvquant_jax.cache.registry import make_scheme

    return make_scheme(spec, rope_theta=cfg.rope_theta, rope_pairing=cfg.rope_pairing)


def cmd_fetch(args):
    from kvquant_jax.models.fetch import fetch_model

    print(fetch_model(args.name))


def cmd_generate(args):
    from kvquant_jax.serving.generate import generate
    from kvquant_jax.serving.sampling import SamplingParams

    if not args.prompt or not args.prompt.strip():
        raise SystemExit("error: --prompt is empty")
    checks.generate_args(args)
    mesh = _mesh(args)
    m = _load(args)
    tok = m.tokenizer
    use_chat = not args.raw and tok.chat_template is not None
    ids = tok.encode_chat(args.prompt, system=args.system) if use_chat else tok.encode(
        args.prompt, add_bos=m.cfg.bos_required)
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    from kvquant_jax import sharding as S

    with S.mesh_context(mesh):
        params = m.params if mesh is None else S.place_params(m.params, m.cfg, mesh)
        res = generate(params, m.cfg, [ids], max_new_tokens=args.max_new_tokens, scheme=_scheme(args.cache, m.cfg),
                       capacity=args.capacity, sampling=sampling, seed=args.seed, attention_impl=args.attention)
    print(tok.decode(res.tokens[0]))
    if args.verbose:
        n = len(res.tokens[0])
        print(json.dumps({"prompt_tokens": len(ids), "new_tokens": n, "load_s": round(m.load_seconds, 3),
                          "prefill_s": round(res.prefill_seconds, 3), "decode_s": round(res.decode_seconds, 3),
                          "decode_tok_per_s_incl_compile": round(max(n - 1, 0) / max(res.decode_seconds, 1e-9), 2)}),
              file=sys.stderr)


def cmd_ppl(args):
    from kvquant_jax.data import load_corpus
    from kvquant_jax.eval.ppl import perplexity

    checks.ppl_args(args)
    mesh = _mesh(args)
    data = 1 if mesh is None else int(mesh.shape["data"])
    if args.max_segments % data:
        raise ValueError(f"--max-segments {args.max_segments} must be a multiple of the mesh's data={data} "
                         "(segments are batched over the data axis)")
    m = _load(args)
    checks.context_fits(args.seq_len, m.cfg, "--seq-len")
    corpus = load_corpus(args.corpus, split="test")
    print(f"[kvq] corpus: {corpus.name} ({corpus.source})", file=sys.stderr)
    t0 = time.perf_counter()
    ids = m.tokenizer.encode(corpus.text)
    tok_s = time.perf_counter() - t0
    nll_fn = None
    if args.cache:
        from kvquant_jax.eval.quantized_ppl import make_nll_fn

        nll_fn = make_nll_fn(_scheme(args.cache, m.cfg), chunk=args.chunk)
    bos = args.bos or (m.cfg.bos_required and not args.no_bos)
    from kvquant_jax import sharding as S

    with S.mesh_context(mesh):
        params = m.params if mesh is None else S.place_params(m.params, m.cfg, mesh)
        res = perplexity(params, m.cfg, ids, seq_len=args.seq_len, max_segments=args.max_segments,
                         batch_size=data, bos_id=m.cfg.bos_id if bos else None, nll_fn=nll_fn,
                         progress=args.progress)
    out = {"ppl": res.ppl, "nll": res.nll, "tokens": res.tokens, "segments": res.segments, "seq_len": res.seq_len,
           "bos": res.bos, "model": m.path, "model_sha256": m.cfg.sha256, "corpus": corpus.name,
           "corpus_sha256": corpus.sha256, "cache": args.cache or "none", "dtype": args.dtype,
           "w8a8": bool(args.w8a8), "smooth_alpha": args.smooth_alpha, "mesh": args.mesh,
           "reduction": args.reduction,
           "load_s": round(m.load_seconds, 3), "tokenize_s": round(tok_s, 3), "eval_s": round(res.seconds, 3)}
    print(json.dumps(out))


def cmd_ledger(args):
    from kvquant_jax.cache.registry import ledger_from_config

    config = args.config
    if config.endswith((".yaml", ".yml", ".json")):
        config = checks.ledger_config(config)
    print(ledger_from_config(config))


def cmd_calibrate(args):
    from kvquant_jax.calibration import kvquant as KC

    config = KC.CalibrationConfig.from_file(args.config)
    checks.new_dir(args.out)
    cal = KC.calibrate(config, progress=args.progress)
    path = KC.save(cal, args.out)
    print(json.dumps({"out": str(path), **KC.summary(cal)}))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kvq", description="kvquant_jax: live-data quantization for LLM serving")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("fetch-model", help="fetch and verify a known model into $KVQ_CACHE_DIR")
    p.add_argument("name", nargs="?", default="smollm2-135m", help="smollm2-135m (default) or gemma3-270m")
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("generate", help="generate a completion")
    _add_model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--system", default=None, help="system message (chat template)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default=None, help="cache scheme: any name of the registry (fp32, bf16, fp8_e4m3, int8, "
                   "int4, int2, qserve4, kivi2, kivi4, static_int8, ...) or an inline spec such as "
                   "'kivi2:residual=64'; the same names configs accept")
    p.add_argument("--capacity", type=int, default=None)
    p.add_argument("--attention", default="auto", choices=["reference", "kernel", "auto"],
                   help="auto (default): packed-KV kernels + cuDNN prefill on GPU, the float32 reference on CPU")
    p.add_argument("-v", "--verbose", action="store_true")
    _add_mesh_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("ppl", help="perplexity (transformers convention: contiguous segments, no BOS; [BOS] + "
                                   "seq_len - 1 tokens for models that need BOS)")
    _add_model_args(p)
    p.add_argument("--corpus", default=None, help="text file, 'wikitext2', or 'builtin' (default: WikiText-2 test "
                                                  "from $KVQ_DATA_DIR or ../shared/data, else built-in)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--max-segments", type=int, default=8)
    p.add_argument("--bos", action="store_true", help="prepend BOS to each segment: [BOS] + seq_len - 1 text tokens, "
                   "NLL over the seq_len - 1 text predictions (the default for models that need BOS: Gemma-3)")
    p.add_argument("--no-bos", action="store_true", help="never prepend BOS (also for models that need it)")
    p.add_argument("--cache", default=None, help="evaluate through a quantized cache scheme")
    p.add_argument("--chunk", type=int, default=128, help="chunk size of the quantized-cache fast path")
    p.add_argument("--progress", action="store_true")
    _add_mesh_args(p)
    p.set_defaults(func=cmd_ppl)

    p = sub.add_parser("ledger", help="print the byte ledger of a cache config")
    p.add_argument("config")
    p.set_defaults(func=cmd_ledger)

    p = sub.add_parser("calibrate", help="offline KVQuant calibration (per-channel pre-RoPE K ranges, Fisher-weighted "
                                         "k-means codebooks) on the calibration text -> artifact DIR")
    p.add_argument("config", help="YAML calibration config (configs/calibration/kvquant_*.yaml)")
    p.add_argument("--out", required=True, help="new artifact directory (Orbax arrays + manifest.json)")
    p.add_argument("--progress", action="store_true")
    p.set_defaults(func=cmd_calibrate)

    from kvquant_jax.eval.commands import add_parsers as add_eval_parsers

    add_eval_parsers(sub)

    from kvquant_jax.eval.tune_cli import add_parsers as add_tune_parsers

    add_tune_parsers(sub)

    from kvquant_jax.calibration.commands import add_parsers as add_prefix_parsers

    add_prefix_parsers(sub)

    from kvquant_jax.serving.engine_cli import add_parsers as add_engine_parsers

    add_engine_parsers(sub)

    args = ap.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"kvq: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
