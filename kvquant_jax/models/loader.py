"""One entry point: ``load_model(name_or_path)`` -> :class:`LoadedModel` (config, params, tokenizer)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from kvquant_jax.models import gguf as gg
from kvquant_jax.models.config import LlamaConfig
from kvquant_jax.models.fetch import DEFAULT_MODEL, KNOWN_MODELS, cache_dir, fetch_model, sha256_file
from kvquant_jax.models.llama import cast_params
from kvquant_jax.models.safetensors_loader import load_hf_folder
from kvquant_jax.models.tokenizer import Tokenizer


@dataclasses.dataclass
class LoadedModel:
    cfg: LlamaConfig
    params: dict          # jnp arrays (see kvquant_jax.models.gguf.load_gguf for the layout)
    tokenizer: Tokenizer
    path: str
    load_seconds: float


def _params_cache(path: Path, digest: str, pairing: str) -> Path:
    return cache_dir() / "dequantized" / f"{path.stem}.{digest[:16]}.{pairing}.npz"


def _write_meta(path: Path, cfg: LlamaConfig, tok: Tokenizer) -> None:
    """Config + tokenizer of a GGUF next to its dequantized weights (keyed by the same file sha256)."""
    d = {"cfg": json.loads(cfg.to_json()), "tokenizer": {"backend": tok.backend.to_str(), "bos_id": tok.bos_id,
                                                         "eos_id": tok.eos_id, "pad_id": tok.pad_id,
                                                         "chat_template": tok.chat_template, "hash": tok.hash}}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(d))
    os.replace(tmp, path)


def _read_meta(path: Path) -> tuple[LlamaConfig, Tokenizer]:
    from tokenizers import Tokenizer as HFTokenizer

    d = json.loads(path.read_text())
    cfg = LlamaConfig(**{k: v for k, v in d["cfg"].items()})
    t = dict(d["tokenizer"])
    return cfg, Tokenizer(backend=HFTokenizer.from_str(t.pop("backend")), **t)


def load_model(model: str | os.PathLike | None = None, *, dtype: str = "fp32", rope_pairing: str = "half_split",
               verbose: bool = False) -> LoadedModel:
    """Load a known model name (fetched on first use), a local ``.gguf`` file, or a HF LLaMA folder.

    The dequantized float32 weights of a GGUF are cached as ``.npz`` under ``$KVQ_CACHE_DIR/dequantized`` keyed by
    the file's sha256, so later loads skip dequantization.
    """
    t0 = time.perf_counter()
    model = str(model or DEFAULT_MODEL)
    if model in KNOWN_MODELS:
        path = fetch_model(model, verbose=verbose)
        digest = KNOWN_MODELS[model].gguf_sha256
    else:
        path = Path(model).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"model {model!r} is neither a known name ({sorted(KNOWN_MODELS)}) nor an existing path")
        digest = ""
    if path.is_dir():
        cfg, params = load_hf_folder(path, rope_pairing=rope_pairing)
        tj = path / "tokenizer.json"
        if not tj.exists():
            raise FileNotFoundError(f"{path}: no tokenizer.json")
        from tokenizers import Tokenizer as HFTokenizer
        backend = HFTokenizer.from_file(str(tj))
        tok = Tokenizer(backend=backend, bos_id=cfg.bos_id, eos_id=cfg.eos_id, pad_id=cfg.eos_id,
                        chat_template=None, hash=hashlib.sha256(tj.read_bytes()).hexdigest()[:16])
    else:
        if not digest:
            digest = sha256_file(path)
        cache = _params_cache(path, digest, rope_pairing)
        meta_file = cache.with_suffix(".meta-v1.json")
        cfg = tok = reader = None
        if cache.exists() and meta_file.exists():       # skip the GGUF reader (~20 s on a 262K-token vocabulary)
            try:
                cfg, tok = _read_meta(meta_file)
            except (OSError, ValueError, KeyError, TypeError) as e:
                print(f"[kvq] ignoring unreadable {meta_file}: {e}", file=sys.stderr)
        if cfg is None:
            reader = gg.open_reader(path)
            cfg = gg.config_from_gguf(reader, rope_pairing=rope_pairing, name=path.stem, sha256=digest)
            tok = Tokenizer.from_gguf_metadata(gg.tokenizer_metadata_from_reader(reader))
        if cache.exists():
            with np.load(cache) as z:
                flat = {k: z[k] for k in z.files}
            params = {"embed": flat.pop("embed"), "final_norm": flat.pop("final_norm"),
                      "layers": {k[len("layers."):]: v for k, v in flat.items() if k.startswith("layers.")}}
            if "lm_head" in flat:
                params["lm_head"] = flat["lm_head"]
        else:
            cfg, params = gg.load_gguf(path, rope_pairing=rope_pairing, sha256=digest, reader=reader)
            try:
                cache.parent.mkdir(parents=True, exist_ok=True)
                flat = {"embed": params["embed"], "final_norm": params["final_norm"],
                        **{f"layers.{k}": v for k, v in params["layers"].items()}}
                if "lm_head" in params:
                    flat["lm_head"] = params["lm_head"]
                tmp = cache.with_suffix(".tmp.npz")
                np.savez(tmp, **flat)
                os.replace(tmp, cache)
            except OSError as e:  # a read-only cache dir only costs speed
                print(f"[kvq] could not cache dequantized weights: {e}", file=sys.stderr)
        if not meta_file.exists() and cache.exists():
            try:
                _write_meta(meta_file, cfg, tok)
            except OSError as e:  # pragma: no cover
                print(f"[kvq] could not cache the model metadata: {e}", file=sys.stderr)
    return LoadedModel(cfg=cfg, params=cast_params(params, dtype), tokenizer=tok, path=str(path),
                       load_seconds=time.perf_counter() - t0)
