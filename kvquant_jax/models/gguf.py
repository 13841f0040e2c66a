"""Load a LLaMA- or Gemma-3-architecture GGUF into a params pytree (``gguf`` package for parsing and dequantization).

Gemma-3 (``general.architecture == "gemma3"``) follows transformers' gemma3 GGUF path: the layer pattern is five
sliding-window ("local") layers then one global layer (layer ``i`` is global iff ``(i + 1) % 6 == 0``), local RoPE
base 10000 and global ``rope.freq_base``, query scale ``query_pre_attn_scalar ** -0.5`` with
``query_pre_attn_scalar = 256``, GeGLU (tanh GELU), QK-norm, post-attention / post-MLP norms, embedding scale
sqrt(hidden) and a tied head.  llama.cpp's converter stores Gemma norm weights as ``1 + w``; transformers subtracts
the 1 on load and adds it back in ``Gemma3RMSNorm``, so the file's values are used as plain multipliers
(``norm_offset = 0``).  Gemma's Q/K rows are in HF order (llama.cpp ropes Gemma in NEOX order; no permutation).

llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` within each head so that llama.cpp can apply RoPE
to adjacent channel pairs (2i, 2i+1). We either undo that permutation (``rope_pairing="half_split"``: Q/K rows in
HF order, RoPE pairs i <-> i + d/2, K cache values identical to transformers') or keep the file's order and apply
interleaved RoPE (``rope_pairing="interleaved"``). Both give identical logits; the choice changes which channels
form a RoPE pair in the stored K cache, so it is recorded in the config and in every cache schema.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from kvquant_jax.models.config import LlamaConfig
from kvquant_jax.models.fetch import sha256_file

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q8_K",
                   "Q2_K", "Q3_K")


class GGUFError(ValueError):
    """A GGUF file that kvquant_jax cannot load (wrong architecture, unsupported tensor type, missing tensor)."""


def _advice(path: Path) -> str:
    try:
        sha = sha256_file(path)
    except OSError:  # pragma: no cover
        sha = "unreadable"
    return (f"re-fetch or re-download the file (a known model: delete it and run `kvq fetch-model`, which verifies "
            f"the published sha256); this copy has sha256 {sha}")


def open_reader(path: str | Path):
    """A ``gguf.GGUFReader`` of ``path`` whose header fields and tensor extents are bounds-checked against the
    file size: a truncated or corrupt file raises :class:`GGUFError` "file truncated or corrupt: expected N bytes
    for tensor T ..., file has M" (plus what to do) instead of an ``IndexError`` or a reshape error."""
    import gguf

    path = Path(path)
    size = path.stat().st_size

    class Short(Exception):
        pass

    class CheckedReader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            end = int(offset) + int(np.empty([], dtype=dtype).itemsize) * int(count)
            if end > len(self.data):
                raise Short(f"the header needs bytes up to offset {end}")
            return super()._get(offset, dtype, count, override_order)

        def _build_tensors(self, start_offs, fields):
            for field in fields:
                try:
                    _n, name_data, _nd, dims, raw_dtype, offset_tensor = field.parts
                    name = bytes(name_data).decode("utf-8", "replace")
                    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_dtype[0]))]
                    n_bytes = int(np.prod(dims.astype(np.float64))) * type_size // block
                    start = int(start_offs) + int(offset_tensor[0])
                except (ValueError, KeyError, TypeError, IndexError):
                    continue            # leave odd layouts (another gguf version) to the reader itself
                if start + n_bytes > size:
                    raise Short(f"expected {n_bytes} bytes for tensor {name} at offset {start}")
            return super()._build_tensors(start_offs, fields)

    try:
        return CheckedReader(str(path))
    except Short as e:
        raise GGUFError(f"{path}: file truncated or corrupt: {e}, file has {size} bytes; {_advice(path)}") from None
    except Exception as e:
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); if it should be one, it is "
                        f"corrupt: {_advice(path)}") from None


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_metadata(reader) -> dict:
    return {k: _field(reader, k) for k in reader.fields if not k.startswith("tokenizer.ggml.") or
            k in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.model",
                  "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.padding_token_id")}


ARCHITECTURES = ("llama", "gemma3")
#: Gemma-3 facts transformers' gemma3 GGUF path takes from its config defaults (the file does not carry them)
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_ROPE_LOCAL_BASE = 10000.0
GEMMA3_QUERY_PRE_ATTN_SCALAR = 256


def config_from_gguf(reader, *, rope_pairing: str = "half_split", name: str = "", sha256: str = "") -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"GGUF architecture is {arch!r}; kvquant_jax loads {' / '.join(map(repr, ARCHITECTURES))} "
                        "models only")
    p = f"{arch}."
    hidden = int(_field(reader, p + "embedding_length"))
    heads = int(_field(reader, p + "attention.head_count"))
    kv = int(_field(reader, p + "attention.head_count_kv", heads))
    head_dim = int(_field(reader, p + "attention.key_length", hidden // heads))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, p + "vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in reader.fields:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    if vocab is None:
        emb = [t for t in reader.tensors if t.name == "token_embd.weight"]
        if not emb:
            raise GGUFError("GGUF has no vocab size, no tokenizer.ggml.tokens and no token_embd.weight")
        vocab = int(emb[0].shape[-1])
    for key in ("embedding_length", "attention.head_count", "feed_forward_length", "block_count"):
        if _field(reader, p + key) is None:
            raise GGUFError(f"GGUF metadata lacks required key {p + key}")
    extra = {}
    if arch == "gemma3":
        extra = _gemma3_fields(reader, p, int(_field(reader, p + "block_count")), hidden, rope_pairing)
    return LlamaConfig(
        vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(_field(reader, p + "feed_forward_length")),
        num_layers=int(_field(reader, p + "block_count")), num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)), rope_pairing=rope_pairing,
        rms_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(_field(reader, p + "context_length", 2048)),
        tie_embeddings="output.weight" not in names,
        bos_id=int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        eos_id=int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        name=name or str(_field(reader, "general.name", "llama")), sha256=sha256, **extra)


def _gemma3_fields(reader, p: str, num_layers: int, hidden: int, rope_pairing: str) -> dict:
    """The Gemma-3 component fields of :class:`LlamaConfig` (module doc)."""
    if rope_pairing != "half_split":
        raise GGUFError("gemma3: only rope_pairing='half_split' is supported (Gemma's Q/K rows are stored in HF "
                        "order and QK-norm weights would need the same permutation)")
    if _field(reader, p + "attn_logit_softcapping") is not None:
        raise GGUFError(f"gemma3: {p}attn_logit_softcapping is set; attention logit soft-capping is not supported")
    window = _field(reader, p + "attention.sliding_window")
    if window is None:
        raise GGUFError(f"GGUF metadata lacks required key {p}attention.sliding_window")
    types = tuple("global" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "local" for i in range(num_layers))
    softcap = _field(reader, p + "final_logit_softcapping")
    return dict(arch="gemma3", norm_offset=0.0, qk_norm=True, post_norms=True, mlp_activation="gelu_tanh",
                layer_types=types, sliding_window=int(window), rope_theta_local=GEMMA3_ROPE_LOCAL_BASE,
                query_scale=GEMMA3_QUERY_PRE_ATTN_SCALAR ** -0.5,
                embed_scale=float(np.float32(hidden ** 0.5)),
                final_logit_softcap=float(softcap) if softcap else 0.0)


def dequantize_tensor(t) -> np.ndarray:
    """float32 array in the file's logical row-major shape ``[ne_{n-1}, ..., ne_0]`` (torch ``[out, in]``)."""
    import gguf

    tname = t.tensor_type.name
    if tname not in SUPPORTED_TYPES:
        raise GGUFError(f"tensor {t.name}: unsupported GGUF tensor type {tname} (supported: {SUPPORTED_TYPES})")
    try:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:  # pragma: no cover - depends on the gguf version
        raise GGUFError(f"tensor {t.name}: gguf cannot dequantize {tname}: {e}") from e
    shape = tuple(int(s) for s in reversed(t.shape))
    return np.asarray(arr, dtype=np.float32).reshape(shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: ``w: [n_head * d, in]`` in interleaved-pair order -> HF order."""
    d2 = w.shape[0] // n_head // 2
    return w.reshape(n_head, d2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str | Path, *, rope_pairing: str = "half_split", sha256: str = "",
              reader=None) -> tuple[LlamaConfig, dict]:
    """Read a llama GGUF. Returns ``(config, params)`` with float32 NumPy arrays laid out for ``x @ W``.
    ``reader``: an :func:`open_reader` of the same ``path`` the caller already holds (opening one parses every
    metadata field, ~10-20 s for a 262K-token vocabulary); None opens one.

    params: ``embed [V, H]``, ``final_norm [H]``, optional ``lm_head [H, V]``, and ``layers`` with arrays stacked
    on a leading layer axis: ``attn_norm [L, H]``, ``wq [L, H, Hq*D]``, ``wk/wv [L, H, Hkv*D]``,
    ``wo [L, Hq*D, H]``, ``ffn_norm [L, H]``, ``w_gate/w_up [L, H, F]``, ``w_down [L, F, H]``; Gemma-3 adds
    ``q_norm, k_norm [L, D]`` and ``post_attn_norm, post_ffn_norm [L, H]``.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model file not found: {path}")
    reader = open_reader(path) if reader is None else reader
    cfg = config_from_gguf(reader, rope_pairing=rope_pairing, name=path.stem, sha256=sha256)
    tensors = {t.name: t for t in reader.tensors}

    def get(name):
        if name not in tensors:
            raise GGUFError(f"{path}: missing tensor {name}")
        return dequantize_tensor(tensors[name])

    keep_file_order = rope_pairing == "interleaved" or cfg.arch == "gemma3"
    names = ["attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down"]
    gemma = {"q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "post_attn_norm": "post_attention_norm",
             "post_ffn_norm": "post_ffw_norm"} if cfg.arch == "gemma3" else {}
    layers: dict[str, list] = {k: [] for k in names + list(gemma)}
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        wq, wk = get(b + "attn_q.weight"), get(b + "attn_k.weight")
        if not keep_file_order:
            wq, wk = unpermute_qk(wq, cfg.num_heads), unpermute_qk(wk, cfg.num_kv_heads)
        for ours, theirs in gemma.items():
            layers[ours].append(get(b + theirs + ".weight"))
        layers["attn_norm"].append(get(b + "attn_norm.weight"))
        layers["wq"].append(wq.T)
        layers["wk"].append(wk.T)
        layers["wv"].append(get(b + "attn_v.weight").T)
        layers["wo"].append(get(b + "attn_output.weight").T)
        layers["ffn_norm"].append(get(b + "ffn_norm.weight"))
        layers["w_gate"].append(get(b + "ffn_gate.weight").T)
        layers["w_up"].append(get(b + "ffn_up.weight").T)
        layers["w_down"].append(get(b + "ffn_down.weight").T)
    params = {
        "embed": get("token_embd.weight"),
        "final_norm": get("output_norm.weight"),
        "layers": {k: np.ascontiguousarray(np.stack(v)) for k, v in layers.items()},
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = np.ascontiguousarray(get("output.weight").T)
    return cfg, params


def tokenizer_metadata(path: str | Path) -> dict:
    """Vocabulary, merges, token types, special ids and chat template from the GGUF metadata."""
    return tokenizer_metadata_from_reader(open_reader(path))


def tokenizer_metadata_from_reader(reader) -> dict:
    out = {
        "architecture": _field(reader, "general.architecture"),
        "model": _field(reader, "tokenizer.ggml.model"),
        "pre": _field(reader, "tokenizer.ggml.pre"),
        "tokens": list(_field(reader, "tokenizer.ggml.tokens") or []),
        "merges": list(_field(reader, "tokenizer.ggml.merges") or []),
        "token_type": list(_field(reader, "tokenizer.ggml.token_type") or []),
        "bos_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "add_bos": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    return out
