"""Tool calls in a model's text, as its chat template has it write them (ModelInfo.tool_format; the
daemon's daemon/text/tool_format.py names the formats):
- "hermes":  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, any number, text around;
- "llama3":  the whole answer one JSON object `{"name": "f", "parameters": {...}}` (or several, split by
             ";"), after an optional `<|python_tag|>`;
- "mistral": `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`;
- "gemma4":  `<|tool_call>call:f{key:value,...}<tool_call|>`, strings between `<|"|>` marks.

ToolCallParser reads the text as it streams: what is plain text comes out as soon as it cannot be the
start of a call (a possible start is held back), each call once it is complete. A block that turns out
not to be a call (its JSON broken, say by max_tokens) comes out as text, as written: nothing the model
wrote is lost.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("hermes", "llama3", "mistral", "gemma4")


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")


@dataclass(frozen=True)
class _Markers:
    start: str
    end: str | None  # None: the call runs to the end of the text


_MARKERS = {"hermes": _Markers("<tool_call>", "</tool_call>"), "mistral": _Markers("[TOOL_CALLS]", None),
            "gemma4": _Markers("<|tool_call>", "<tool_call|>"), "llama3": _Markers("<|python_tag|>", None)}


class ToolCallParser:
    def __init__(self, fmt: str) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"no tool-call format {fmt!r} (known: {', '.join(FORMATS)})")
        self.fmt, self._markers = fmt, _MARKERS[fmt]
        self._held = ""  # text not given out yet: a possible start, or a call still being written
        self._in_call = False
        self._started = False  # any text seen (llama3: a call is the whole answer, so only at the start)
        self._space = ""  # whitespace after a call, held back
        self.calls: list[ParsedCall] = []  # every call so far

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Text of the answer in; the plain text that can go out now, and the calls completed by it."""
        self._held += text
        out: list[str] = []
        first = len(self.calls)
        while True:
            if self._in_call:
                end = self._markers.end
                if end is None or (at := self._held.find(end)) < 0:
                    break
                self._call(self._held[:at], self._markers.start + self._held[: at + len(end)], out)
                self._held, self._in_call = self._held[at + len(end):], False
                continue
            if self.fmt == "llama3" and not self._started and self._held.lstrip()[:1] == "{":
                self._in_call, self._started = True, True  # a bare JSON answer: a call, judged at the end
                self._markers = _Markers("", None)
                continue
            at = self._held.find(self._markers.start)
            if at >= 0:
                self._text(self._held[:at], out)
                self._held, self._in_call = self._held[at + len(self._markers.start):], True
                self._started = True
                continue
            keep = _possible_start(self._held, self._markers.start)
            if self.fmt == "llama3" and not self._started and not self._held.strip():
                keep = len(self._held)  # only whitespace yet: the answer may still open with "{"
            given = self._held[: len(self._held) - keep]
            self._text(given, out)
            self._held = self._held[len(self._held) - keep:]
            self._started = self._started or bool(given.strip())
            break
        return "".join(out), self.calls[first:]

    def close(self) -> tuple[str, list[ParsedCall]]:
        """The end of the answer: the rest of the text, and a call that ran to the end."""
        out: list[str] = []
        first = len(self.calls)
        if self._in_call:
            self._call(self._held, self._markers.start + self._held, out)
        else:
            self._text(self._held, out)
        self._held, self._in_call = "", False
        self._space = ""  # whitespace after the last call is no text
        return "".join(out), self.calls[first:]

    def _text(self, text: str, out: list[str]) -> None:
        """Plain text to give out; whitespace after a call is held back until text follows it."""
        if self.calls and not text.strip():
            self._space += text
            return
        out.append(self._space + text)
        self._space = ""

    def _call(self, body: str, written: str, out: list[str]) -> None:
        """The calls in a block's `body`; where it holds none, the block as `written` is text."""
        try:
            found = _parse(self.fmt, body)
        except (ValueError, TypeError, KeyError):
            found = []
        if found:
            self.calls += found
        else:
            self._text(written, out)


def parse_tool_calls(fmt: str, text: str) -> tuple[str, list[ParsedCall]]:
    """A whole answer's plain text and calls."""
    parser = ToolCallParser(fmt)
    content, calls = parser.feed(text)
    rest, more = parser.close()
    return content + rest, calls + more


def _possible_start(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _parse(fmt: str, body: str) -> list[ParsedCall]:
    if fmt == "hermes":
        return [_from_json(json.loads(body))]
    if fmt == "gemma4":
        match = re.fullmatch(r"\s*call:([\w.\-]+)(\{.*\})\s*", body, re.S)
        if match is None:
            return []
        return [ParsedCall(match.group(1), json.dumps(_GemmaValue(match.group(2)).read()))]
    values = _json_values(body.strip())
    if fmt == "mistral" and len(values) == 1 and isinstance(values[0], list):
        values = values[0]
    return [_from_json(v) for v in values]


def _from_json(value: Any) -> ParsedCall:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ValueError("not a call")
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # already JSON text (some models write it so)
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("arguments are not an object")
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _json_values(text: str) -> list[Any]:
    """JSON values one after another, split by whitespace or ";" (Llama 3's parallel calls)."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while at < len(text):
        value, at = decoder.raw_decode(text, at)
        values.append(value)
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
    if not values:
        raise ValueError("no JSON")
    return values


class _GemmaValue:
    """Gemma 4's argument syntax to Python: {key:value,...}, [..], <|"|>strings<|"|>, numbers, true,
    false, null; keys bare."""

    QUOTE = '<|"|>'

    def __init__(self, text: str) -> None:
        self.text, self.at = text, 0

    def read(self) -> Any:
        value = self._value()
        if self.text[self.at:].strip():
            raise ValueError("text after the arguments")
        return value

    def _value(self) -> Any:
        self._space()
        t = self.text
        if t.startswith(self.QUOTE, self.at):
            end = t.find(self.QUOTE, self.at + len(self.QUOTE))
            if end < 0:
                raise ValueError("an unclosed string")
            value, self.at = t[self.at + len(self.QUOTE): end], end + len(self.QUOTE)
            return value
        if t.startswith("{", self.at):
            return self._object()
        if t.startswith("[", self.at):
            self.at += 1
            items: list[Any] = []
            while not self._next("]"):
                items.append(self._value())
                self._next(",")
            return items
        match = re.compile(r"-?\d+(\.\d+)?([eE][+-]?\d+)?|true|false|null").match(t, self.at)
        if match is None:
            raise ValueError(f"no value at {self.at}")
        self.at = match.end()
        return json.loads(match.group(0))

    def _object(self) -> dict[str, Any]:
        self.at += 1
        out: dict[str, Any] = {}
        while not self._next("}"):
            self._space()
            match = re.compile(r"[^:{}\[\],\s]+").match(self.text, self.at)
            if match is None:
                raise ValueError(f"no key at {self.at}")
            key = match.group(0)
            if key.startswith(self.QUOTE) and key.endswith(self.QUOTE):
                key = key[len(self.QUOTE): -len(self.QUOTE)]
            self.at = match.end()
            if not self._next(":"):
                raise ValueError(f"no ':' after {key!r}")
            out[key] = self._value()
            self._next(",")
        return out

    def _next(self, char: str) -> bool:
        self._space()
        if self.text.startswith(char, self.at):
            self.at += 1
            return True
        if self.at >= len(self.text):
            raise ValueError("the arguments end early")
        return False

    def _space(self) -> None:
        while self.at < len(self.text) and self.text[self.at].isspace():
            self.at += 1
