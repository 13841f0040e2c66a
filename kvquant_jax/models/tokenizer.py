"""Tokenizer built from GGUF metadata with HF ``tokenizers`` (byte-level BPE), plus the chat template.

For ``tokenizer.ggml.model == "gpt2"`` the vocabulary and merges are byte-level BPE; tokens the file marks as
CONTROL (type 3) are added as special tokens so they are matched whole. The result matches transformers'
GGUF tokenizer token for token (tested on the whole WikiText-2 test split).
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

        if meta.get("model") != "gpt2":
            raise ValueError(f"tokenizer model {meta.get('model')!r} is not supported (byte-level BPE 'gpt2' only)")
        tokens = meta["tokens"]
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
        user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
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
