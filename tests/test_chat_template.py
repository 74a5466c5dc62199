"""Chat templates render exactly as transformers' apply_chat_template(..., tokenize=False) renders the
same template string: ChatML, a Qwen2.5-style template with tools, Qwen3's own (tools, calls, tool
results, thinking), a Llama-3.1-style one (strftime_now, tojson(indent=...)), and one using the
environment's extras (namespace, dict, break, {% generation %}, reasoning). Errors come out as
ChatTemplateError; the sandbox holds."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ember.daemon.text.chat_template import ChatTemplate, ChatTemplateError
from tiny_models import DEMO_TOKENIZER

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
          " + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA31 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You have access to the following functions.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls is defined %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}<|eot_id|>" }}
    {%- elif message.role == "tool" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

EXTRAS = """{%- set ns = namespace(count=0, last_user=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}
  {%- if loop.index0 > 6 %}{% break %}{% endif %}
  {%- if m.role == 'assistant' %}
    {%- if m.reasoning_content is defined and loop.index0 > ns.last_user -%}
      <think>{{ m.reasoning_content }}</think>
    {%- endif %}
    {% generation %}{{ m.content | default('(call)') }}{% endgeneration %}
  {%- else %}
    {{ dict(role=m.role, n=loop.index).items() | list | tojson }} {{ m.content if m.content is defined else '-' }}
  {%- endif %}
  {%- set ns.count = ns.count + 1 %}
{%- endfor %}
[{{ ns.count }}]{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""

CHAT = [{"role": "system", "content": "You are <helpful> & \"terse\"."}, {"role": "user", "content": "  Hi! 日本 "},
        {"role": "assistant", "content": "Hello.\n"}, {"role": "user", "content": "Bye"}]
TOOL_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "°C"}}}
TOOL_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
             {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "tool", "content": "sunny"},
             {"role": "assistant", "content": "21 °C, sunny.", "reasoning_content": "The tool said so."},
             {"role": "user", "content": "Thanks"}]
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "Weather <now> & here", "parameters": PARAMETERS}}]

# Qwen3's own template (tests/fixtures/qwen3_chat_template.jinja), with a history as the daemon passes it
# (daemon/text/tool_format.template_messages: an assistant's content "" beside its calls)
QWEN3 = (Path(__file__).parent / "fixtures" / "qwen3_chat_template.jinja").read_text()
QWEN3_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
              {"role": "assistant", "content": "", "tool_calls": [{**TOOL_CALL, "id": "call_1"}, TOOL_CALL]},
              {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": "call_1"},
              {"role": "tool", "content": "sunny", "tool_call_id": "call_2"},
              {"role": "assistant", "content": "<think>\nThe tool said so.\n</think>\n\n21 °C, sunny."}]

CASES = [(CHATML, CHAT, {}), (QWEN25, CHAT, {}), (QWEN25, TOOL_CHAT, {"tools": TOOLS}), (LLAMA31, CHAT, {}),
         (LLAMA31, TOOL_CHAT[:5], {"tools": TOOLS}), (EXTRAS, TOOL_CHAT, {}),
         (EXTRAS, CHAT, {"enable_thinking": False}), (QWEN3, QWEN3_CHAT, {"tools": TOOLS}),
         (QWEN3, QWEN3_CHAT[:3], {"tools": TOOLS, "enable_thinking": False}), (QWEN3, CHAT, {})]


@pytest.fixture(scope="module")
def hf() -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(DEMO_TOKENIZER / "tokenizer.json"),
                                                bos_token="<|endoftext|>", eos_token="<|endoftext|>")


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_render_equals_transformers(hf: Any, case: int, generation_prompt: bool) -> None:
    source, messages, extra = CASES[case]
    expected = hf.apply_chat_template(messages, chat_template=source, tokenize=False,
                                      add_generation_prompt=generation_prompt, **extra)
    ours = ChatTemplate(source, "<|endoftext|>", "<|endoftext|>").render(messages, generation_prompt, **extra)
    assert ours == expected


def test_render_leaves_the_messages_alone() -> None:
    messages = [dict(m) for m in TOOL_CHAT]
    ChatTemplate(EXTRAS).render(messages)
    assert messages == TOOL_CHAT


def test_errors_are_clear() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(ChatTemplateError, match="no bad roles"):
        ChatTemplate("{{ raise_exception('no bad roles') }}").render(CHAT)
    with pytest.raises(ChatTemplateError, match="'role'"):
        ChatTemplate(CHATML).render([{"content": "x"}])
    with pytest.raises(ChatTemplateError, match="TypeError"):
        ChatTemplate("{{ messages[0].content + 1 }}").render(CHAT)
    with pytest.raises(ChatTemplateError, match="no attribute 'content'"):  # ChatML on a tool call
        ChatTemplate(CHATML).render(TOOL_CHAT)


@pytest.mark.parametrize("source", [
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "{{ raise_exception.__globals__ }}",
    "{{ dict.__call__.__globals__['json'] }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}",
    "{{ messages.append(1) }}",
])
def test_sandbox_holds(source: str) -> None:
    """Unsafe attributes are refused or read as undefined (empty); nothing can be changed."""
    try:
        assert ChatTemplate(source).render(CHAT) == ""
    except ChatTemplateError:
        pass


def test_the_tool_call_format_each_template_writes() -> None:
    """daemon/text/tool_format.tool_format: what the clients' parser reads a model's calls as."""
    from ember.daemon.text.tool_format import tool_format

    mistral = "{%- if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]"
    gemma = "{%- if tools %}<|tool>...<tool|>{% endif %}{{- '<|tool_call>call:' + name }}"
    cases = [(QWEN3, "hermes"), (QWEN25, "hermes"), (LLAMA31, "llama3"), (mistral, "mistral"), (gemma, "gemma4"),
             (CHATML, ""), (EXTRAS, ""), (None, "")]
    for source, fmt in cases:
        assert tool_format(source) == fmt
