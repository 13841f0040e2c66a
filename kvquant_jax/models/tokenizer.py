"""Tokenizer built from GGUF metadata with HF ``tokenizers``, plus the chat template.

* ``tokenizer.ggml.model == "gpt2"`` (SmolLM2): byte-level BPE from the file's vocabulary and merges.
* ``"llama"`` (SentencePiece) in a Gemma file (Gemma-3): a SentencePiece-style BPE with byte fallback, built as
  transformers' GGUF path builds it: spaces normalized to "▁", tokens made only of spaces respelled with "▁", and
  -- the file lists no merges -- merges recovered from the vocabulary (every split of a token into two vocabulary
  tokens), ranked by the token's position in the file (Gemma's scores do not follow its merge order).
Tokens the file marks as CONTROL (type 3) are added as special tokens so they are matched whole, USER_DEFINED (4)
ones as plain added tokens. The result matches transformers' GGUF tokenizer token for token (tested on the whole
WikiText-2 test split).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from functools import cached_property

CONTROL = 3
USER_DEFINED = 4


class UnsafeChatTemplateError(ValueError):
    """The model file's chat template failed in the sandbox (an unsafe operation, a syntax error or its own
    ``raise_exception``)."""


def _respell(token: str) -> str:
    """A Gemma token made only of spaces is stored with real spaces; the "▁"-normalized text looks it up as "▁"s."""
    return "\u2581" * len(token) if " " in token and not token.strip() else token


def recover_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary without merges: every split of a token into two vocabulary tokens,
    best first by the token's position in the file (ties: the pieces' ids, then the longer left piece first),
    as transformers' ``generate_merges`` ranks them for Gemma GGUF files."""
    vocab = {t: i for i, t in enumerate(tokens)}
    rank = {t: -i for i, t in enumerate(tokens)}     # a repeated spelling keeps its first place, its last id
    merges = []
    for tok, score in rank.items():
        local = [(tok[:j], tok[j:]) for j in range(1, len(tok)) if tok[:j] in vocab and tok[j:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges.extend((lr[0], lr[1], score) for lr in local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _gemma_backend(tokens: list[str]):
    """The SentencePiece-style BPE backend of a Gemma GGUF vocabulary (module doc)."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers

    tokens = [_respell(t) for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=recover_merges(tokens), fuse_unk=True, unk_token="<unk>", dropout=None,
                     byte_fallback=True)
    tok = HFTokenizer(bpe)
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


@dataclasses.dataclass
class Tokenizer:
    """Wraps a ``tokenizers.Tokenizer`` with the model's special ids and chat template.

    ``encode(text)`` never adds BOS unless asked (``add_bos=True``); ``encode_chat`` renders the chat template.
    ``hash`` identifies vocabulary + merges + specials (part of cache/prefix/artifact identity).
    """

    backend: object
    bos_id: int
    eos_id: int
    pad_id: int
    chat_template: str | None
    hash: str

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

        kind = meta.get("model")
        gemma = kind == "llama" and str(meta.get("architecture", "")).startswith("gemma")
        if kind != "gpt2" and not gemma:
            raise ValueError(f"tokenizer model {kind!r} (architecture {meta.get('architecture')!r}) is not supported: "
                             "byte-level BPE 'gpt2', or SentencePiece 'llama' in a Gemma file")
        tokens = meta["tokens"]
        if gemma:
            tok = _gemma_backend(tokens)
        else:
            vocab = {t: i for i, t in enumerate(tokens)}
            merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
            bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
            tok = HFTokenizer(bpe)
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
            tok.decoder = decoders.ByteLevel()
        types = meta.get("token_type") or []
        specials = [AddedToken(t, special=True, normalized=False)
                    for t, ty in zip(tokens, types) if ty == CONTROL]
        if specials:
            tok.add_special_tokens(specials)
        spelled = set(map(_respell, tokens)) if gemma else set()    # transformers adds only those it can look up
        user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED
                and (not gemma or t in spelled)]
        if user:
            tok.add_tokens(user)
        h = hashlib.sha256()
        h.update(json.dumps([tokens, meta["merges"], types[:len(tokens)]]).encode())
        h.update(f"{meta.get('bos_id')},{meta.get('eos_id')},{meta.get('pre')}".encode())
        eos = int(meta.get("eos_id") if meta.get("eos_id") is not None else 0)
        return cls(backend=tok, bos_id=int(meta.get("bos_id") or 0), eos_id=eos,
                   pad_id=int(meta.get("pad_id") if meta.get("pad_id") is not None else eos),
                   chat_template=meta.get("chat_template"), hash=h.hexdigest()[:16])

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] + ids) if add_bos else ids

    def decode(self, ids, *, skip_special: bool = True) -> str:
        return self.backend.decode(list(map(int, ids)), skip_special_tokens=skip_special)

    @cached_property
    def _template(self):
        """The chat template compiled in jinja2's immutable sandbox (as transformers does): the template comes from
        the model file, which is untrusted, so attribute access to internals (``__globals__``, ``__class__`` ...),
        calls of unsafe callables and mutation of the render arguments raise :class:`UnsafeChatTemplateError`."""
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not self.chat_template:
            return None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)

        def raise_exception(message):
            raise TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template)
        except TemplateError as e:
            raise UnsafeChatTemplateError(f"the model's chat template does not compile: {e}") from e

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """Render ``messages`` (``[{"role", "content"}, ...]``) with the model's template, sandboxed."""
        from jinja2 import TemplateError
        from jinja2.exceptions import SecurityError

        if self._template is None:
            raise ValueError("this model has no chat template; use raw prompts")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.backend.id_to_token(self.bos_id),
                                         eos_token=self.backend.id_to_token(self.eos_id))
        except SecurityError as e:
            raise UnsafeChatTemplateError(
                f"the model's chat template tried an operation the sandbox forbids ({e}); the model file is not "
                "trusted: render with raw prompts (--raw) or fix the template") from e
        except TemplateError as e:
            raise UnsafeChatTemplateError(f"the model's chat template failed to render: {e}") from e

    def encode_chat(self, prompt: str, system: str | None = None) -> list[int]:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return self.encode(self.apply_chat_template(msgs))
