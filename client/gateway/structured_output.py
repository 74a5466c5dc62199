"""Structured output on the gateway: what each API calls it, as the one Grammar a Generate carries (the
daemon compiles and enforces it: daemon/text/grammar.py).

- OpenAI's `response_format`: `json_object` (any JSON object) or `json_schema` ({name, schema, strict});
- the Responses API's `text.format`, the same two in its flat shape ({type, name, schema, strict});
- Ollama's `format`: "json" or a JSON schema;
- the extras of the servers tools also speak, on both OpenAI endpoints: llama.cpp's `grammar` (GBNF, or
  Lark) and `json_schema`, vLLM's `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`.
At most one of them per request. A schema is passed on as JSON text: the daemon checks it, and a bad one
is the request's 400 with llguidance's reason.
"""
from __future__ import annotations

from typing import Any

import msgspec

from ember.client.gateway.errors import bad_request
from ember.client.gateway.openai_schema import ResponseFormat, SamplingBody
from ember.protocol.messages import Grammar

_encode = msgspec.json.Encoder().encode


def openai_grammar(req: SamplingBody, fmt: ResponseFormat | None = None) -> Grammar | None:
    """The grammar of an OpenAI chat or completion request: its response_format (chat), or one of the
    extras."""
    given = [g for g in (_response_format(fmt), *_extras(req)) if g is not None]
    if len(given) > 1:
        raise bad_request("give one of response_format, grammar, json_schema and the guided_* options, not several",
                          "response_format")
    return given[0] if given else None


def responses_grammar(text: Any) -> Grammar | None:
    """The Responses API's text.format: {"type": "text" | "json_object" | "json_schema", name, schema, strict}."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad_request("text.format must be an object with a type", "text.format")
    kind = fmt["type"]
    if kind == "json_schema":
        return _schema(fmt.get("schema"), "text.format.schema")
    return _simple_format(kind, "text.format")


def ollama_grammar(fmt: Any) -> Grammar | None:
    """Ollama's format: "json" (any JSON object) or a JSON schema."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return Grammar("json")
    if isinstance(fmt, dict):
        return _schema(fmt, "format")
    raise bad_request(f"format must be \"json\" or a JSON schema, got {fmt!r}", "format")


def _response_format(fmt: ResponseFormat | None) -> Grammar | None:
    if fmt is None:
        return None
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise bad_request("response_format json_schema needs its json_schema (name, schema)",
                              "response_format.json_schema")
        return _schema(fmt.json_schema.schema, "response_format.json_schema.schema")
    return _simple_format(fmt.type, "response_format")


def _simple_format(kind: str, param: str) -> Grammar | None:
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json")
    raise bad_request(f"{param} type must be text, json_object or json_schema, got {kind!r}", param)


def _schema(schema: Any, param: str) -> Grammar:
    if schema is None:  # a json_schema format without a schema: any JSON object, as OpenAI takes it
        return Grammar("json")
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{param} must be a JSON schema (an object)", param)
    return Grammar("json_schema", _encode(schema).decode())


def _extras(x: SamplingBody) -> list[Grammar | None]:
    guided_json = x.guided_json
    if isinstance(guided_json, str):  # vLLM takes the schema as JSON text too
        try:
            guided_json = msgspec.json.decode(guided_json)
        except msgspec.DecodeError as e:
            raise bad_request(f"guided_json is not valid JSON: {e}", "guided_json") from None
    return [
        None if x.grammar is None else Grammar("gbnf", x.grammar),  # llguidance reads GBNF and Lark alike
        None if x.json_schema is None else _schema(x.json_schema, "json_schema"),
        None if guided_json is None else _schema(guided_json, "guided_json"),
        None if x.guided_regex is None else Grammar("regex", x.guided_regex),
        None if x.guided_choice is None else Grammar("choice", _encode(x.guided_choice).decode()),
        None if x.guided_grammar is None else Grammar("gbnf", x.guided_grammar),
    ]
