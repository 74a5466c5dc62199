"""ChatTemplate: chat messages -> prompt text with the model's own jinja2 template, rendered as
transformers' apply_chat_template(..., tokenize=False) renders it: the same sandboxed environment
(trim_blocks, lstrip_blocks, loop controls, the {% generation %} tag), the same helpers (raise_exception,
tojson without HTML escaping, strftime_now, dict, a namespace that refuses "_" names) and the same
inputs (messages copied as plain data with None values dropped, tools and documents, special tokens).
Templates come from model files, so they are untrusted code: the sandbox is immutable and any failure
comes out as ChatTemplateError."""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template cannot be compiled, or failed (or refused) to render the messages."""


class ChatTemplate:
    """One model's chat template, compiled once."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from None
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt for `messages` ([{"role": ..., "content": ...}, ...]). extra: more template
        variables, e.g. tools=[...] (JSON schemas), documents=[...], enable_thinking=False."""
        if not all(isinstance(m, Mapping) and "role" in m for m in messages):
            raise ChatTemplateError("each chat message must be a mapping with a 'role' (and usually 'content')")
        variables = dict(tools=None, documents=None, bos_token=self.bos_token, eos_token=self.eos_token) | extra
        try:
            return self._template.render(messages=_messages(messages), add_generation_prompt=add_generation_prompt,
                                         **_plain(variables))
        except jinja2.TemplateError as e:  # raise_exception(...) and sandbox violations included
            raise ChatTemplateError(f"chat template failed: {e}") from None
        except Exception as e:  # the template's own bugs: a bad index, a type error...
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None


def _messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain copies, as transformers passes them: keys whose value is None dropped (templates handle a
    missing key better than a None), and the reasoning copied under the names templates read."""
    out = []
    for message in messages:
        m = {k: v for k, v in _plain(message).items() if v is not None}
        reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _plain(value: Any) -> Any:
    """JSON-like data only (dicts, lists, scalars): the template can reach no object's methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    for kind in (bool, str, int, float):  # subclasses (enums, numpy scalars) as their base type
        if isinstance(value, kind):
            return kind(value)
    return f"<{type(value).__name__}>"


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now, dict=_Dict(), namespace=_Namespace)
    return env


class _GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} marks the assistant's text for training masks in
    transformers; rendering keeps the text as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # as transformers: no HTML escaping (jinja's own tojson escapes <, >, & for web pages)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Dict:
    """dict(...) and dict.fromkeys(...) for templates, without the type itself (no type hacks)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace(), refusing attribute names that start with "_" (a way to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick: namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set the namespace attribute {name!r}")
