"""Chat templates come from the (untrusted) model file: they render in jinja2's immutable sandbox.

Each hostile template below ran a shell command / read internals under the old plain ``jinja2.Environment``
(a crafted GGUF ran code on ``kvq generate`` and in IntactKV calibration); now it raises a clear error and the
side effect never happens.
"""
import pytest

from kvquant_jax.models.tokenizer import Tokenizer, UnsafeChatTemplateError


def _tokenizer(template: str) -> Tokenizer:
    tokens = ["<s>", "</s>", "a", "b", "ab"]
    meta = {"model": "gpt2", "tokens": tokens, "merges": ["a b"], "token_type": [3, 3, 1, 1, 1],
            "bos_id": 0, "eos_id": 1, "pre": "default", "chat_template": template}
    return Tokenizer.from_gguf_metadata(meta)


MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("payload", [
    # the classic escape through a global's function globals to ``os``
    "{{ cycler.__init__.__globals__.os.system('touch {marker}') }}",
    "{{ joiner.__init__.__globals__['os'].popen('touch {marker}').read() }}",
    # walking the class hierarchy to reach arbitrary classes
    "{{ ''.__class__.__mro__[1].__subclasses__() }}{{ lipsum.__globals__.os.system('touch {marker}') }}",
])
def test_template_touching_internals_raises_and_runs_nothing(tmp_path, payload):
    marker = tmp_path / "pwned"
    tok = _tokenizer(payload.replace("{marker}", str(marker)))
    with pytest.raises(UnsafeChatTemplateError, match="sandbox forbids"):
        tok.apply_chat_template(MSGS)
    assert not marker.exists()


def test_template_cannot_mutate_its_arguments():
    tok = _tokenizer("{% set _ = messages.append({'role': 'x', 'content': 'y'}) %}{{ messages | length }}")
    msgs = [dict(m) for m in MSGS]
    with pytest.raises(UnsafeChatTemplateError):
        tok.apply_chat_template(msgs)
    assert msgs == MSGS


def test_ordinary_template_still_renders():
    tok = _tokenizer("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>{% endif %}{{ bos_token }}")
    assert tok.apply_chat_template(MSGS) == "<|user|>hi\n<|assistant|><s>"


def test_raise_exception_and_syntax_errors_are_clear():
    tok = _tokenizer("{{ raise_exception('only user turns are allowed') }}")
    with pytest.raises(UnsafeChatTemplateError, match="only user turns are allowed"):
        tok.apply_chat_template(MSGS)
    with pytest.raises(UnsafeChatTemplateError, match="does not compile"):
        _tokenizer("{% for m in messages %}").apply_chat_template(MSGS)
