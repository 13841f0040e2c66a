"""One entry point: ``load_model(name_or_path)`` -> :class:`LoadedModel` (config, params, tokenizer)."""
from __future__ import annotations

import dataclasses
import hashlib
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
        reader = gg.open_reader(path)
        cfg = gg.config_from_gguf(reader, rope_pairing=rope_pairing, name=path.stem, sha256=digest)
        if cache.exists():
            with np.load(cache) as z:
                flat = {k: z[k] for k in z.files}
            params = {"embed": flat.pop("embed"), "final_norm": flat.pop("final_norm"),
                      "layers": {k[len("layers."):]: v for k, v in flat.items() if k.startswith("layers.")}}
            if "lm_head" in flat:
                params["lm_head"] = flat["lm_head"]
        else:
            cfg, params = gg.load_gguf(path, rope_pairing=rope_pairing, sha256=digest)
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
        tok = Tokenizer.from_gguf_metadata(gg.tokenizer_metadata_from_reader(reader))
    return LoadedModel(cfg=cfg, params=cast_params(params, dtype), tokenizer=tok, path=str(path),
                       load_seconds=time.perf_counter() - t0)
