"""Chat templates rendered like transformers' apply_chat_template on the same template string."""
from __future__ import annotations

import pytest

from ember.daemon.chat_template import ChatTemplate, ChatTemplateError
from tiny_models import DEMO_TOKENIZER

transformers = pytest.importorskip("transformers")

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{{ content }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
TOOLS = ("{% for m in messages %}{% if m.role == 'system' %}{{ m.content | tojson }}{% elif m.role == 'bad' %}"
         "{{ raise_exception('no bad roles') }}{% else %}[{{ m.role }}] {{ m.content }}\n{% endif %}{% endfor %}")
MESSAGES = [{"role": "system", "content": "You are <helpful> & \"terse\"."}, {"role": "user", "content": "  Hi! 日本 "},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]


@pytest.mark.parametrize("source", [CHATML, LLAMA3, TOOLS])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_render_equals_transformers(source: str, generation_prompt: bool) -> None:
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(DEMO_TOKENIZER / "tokenizer.json"),
                                              bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    expected = hf.apply_chat_template(MESSAGES, chat_template=source, tokenize=False,
                                      add_generation_prompt=generation_prompt)
    ours = ChatTemplate(source, "<|endoftext|>", "<|endoftext|>").render(MESSAGES, generation_prompt)
    assert ours == expected


def test_errors_are_clear() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(ChatTemplateError, match="no bad roles"):
        ChatTemplate(TOOLS).render([{"role": "bad", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="role"):
        ChatTemplate(CHATML).render([{"content": "x"}])


def test_sandbox_blocks_attribute_escapes() -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}").render(MESSAGES)
