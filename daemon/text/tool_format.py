"""Tool calling on the daemon's side: which format a model's chat template has it write calls in, the
template variables of a chat with tools (OpenAI's shapes, as transformers passes them), and the grammar
that makes a call certain where a request requires one (tool_choice required, or a named function).

The formats, by what the template writes (the clients' parser is client/tool_calls.py):
- "hermes": `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Qwen2.5, Qwen3, QwQ, Hermes);
- "llama3": a JSON object `{"name": ..., "parameters": {...}}`, alone (Llama 3.1-3.3);
- "mistral": `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- "gemma4": `<|tool_call>call:NAME{key:value,...}<tool_call|>` with Gemma's own value syntax.
Enforced by a grammar: hermes and llama3 (each call's arguments by its function's JSON schema). Mistral's
and Gemma's markers are control tokens and Gemma's arguments are not JSON: their calls are parsed, not
enforced (a required call there is refused, saying so).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ember.daemon.text.grammar import JSON_OPTIONS, GrammarError
from ember.protocol.messages import ChatMessage, Tool

HERMES, LLAMA3, MISTRAL, GEMMA4 = "hermes", "llama3", "mistral", "gemma4"
ENFORCED = (HERMES, LLAMA3)


def tool_format(template: str | None) -> str:
    """The tool-call format `template` writes, "" when it renders no tools."""
    if not template or "tools" not in template:
        return ""
    if "<|tool_call>" in template:
        return GEMMA4
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
        return LLAMA3
    return ""


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as a template reads them: OpenAI's shapes, an assistant's tool calls with their
    arguments as an object where they parse (templates write them with tojson)."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                               for c in m.tool_calls]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
        out.append(d)
    return out


def template_tools(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """Tools as templates read them: OpenAI's {"type": "function", "function": {...}}; ValueError for a
    parameters schema that is not a JSON object."""
    out = []
    for t in tools:
        try:
            parameters = json.loads(t.parameters)
        except json.JSONDecodeError as e:
            raise ValueError(f"tool {t.name!r}: parameters is not valid JSON: {e}") from None
        if not isinstance(parameters, dict):
            raise ValueError(f"tool {t.name!r}: parameters must be a JSON schema object")
        out.append({"type": "function", "function": {"name": t.name, "description": t.description,
                                                     "parameters": parameters}})
    return out


def call_grammar(fmt: str, tools: Sequence[Tool], name: str = "", parallel: bool = True) -> str:
    """A Lark grammar (llguidance's dialect) of one call in `fmt` (one or more where `parallel`, in the
    formats that have several), of `name` alone where given, each call's arguments following its
    function's schema."""
    if fmt not in ENFORCED:
        raise GrammarError(f"this model writes tool calls as {fmt or 'nothing ember knows'}, which ember parses "
                           f"but cannot enforce: a required tool call needs the {' or '.join(ENFORCED)} format")
    chosen = [t for t in tools if not name or t.name == name]
    if not chosen:
        raise GrammarError(f"tool_choice names {name!r}, which is not among the tools")
    key = "parameters" if fmt == LLAMA3 else "arguments"
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", key],
              "properties": {"name": {"const": t.name}, key: json.loads(t.parameters)}} for t in chosen]
    schema = json.dumps({**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_OPTIONS})
    if fmt == LLAMA3:
        return f"start: %json {schema}\n"
    more = ' ("\\n" call)*' if parallel else ""
    return f'start: call{more}\ncall: "<tool_call>\\n" %json {schema} "\\n</tool_call>"\n'


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # templates write a string as it is
