"""Structured output through every API a client may use, against a real daemon on the demo model: the
openai SDK's `.parse()` with a pydantic model (chat and Responses), json_schema and json_object,
streamed and whole, llama.cpp's `grammar` extra, Ollama's `format`, and the native SDK; a bad schema is
a 400 with llguidance's reason. The tiny model writes whatever it likes at temperature 1, so the
schemas' answers parse only because the daemon enforced them."""
from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
import openai
import pytest
from gateway_setup import MODEL
from pydantic import BaseModel, Field

from ember.client.errors import BadRequest

CHAT = [{"role": "user", "content": "Describe a person as JSON."}]


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["city", "tags"], "additionalProperties": False}


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    for seed in range(3):
        r = client.chat.completions.parse(model=MODEL, messages=CHAT, response_format=Person,  # type: ignore[arg-type]
                                          temperature=1.0, seed=seed, max_tokens=120)
        person = r.choices[0].message.parsed
        assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"


def test_json_schema_whole_and_streamed(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, response_format=fmt,  # type: ignore[arg-type]
                                           temperature=1.0, seed=5, max_tokens=120)
    jsonschema.validate(json.loads(whole.choices[0].message.content or ""), SCHEMA)
    chunks = client.chat.completions.create(model=MODEL, messages=CHAT, response_format=fmt,  # type: ignore[arg-type]
                                            temperature=1.0, seed=5, max_tokens=120, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    several = client.chat.completions.create(model=MODEL, messages=CHAT, response_format=fmt,  # type: ignore[arg-type]
                                             temperature=1.0, seed=9, max_tokens=120, n=3)
    for choice in several.choices:
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_json_object_and_grammar_extras(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Answer in JSON: "}],
                                       response_format={"type": "json_object"}, temperature=0, max_tokens=100)
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    yes_no = client.completions.create(model=MODEL, prompt="Is it done?", max_tokens=8, temperature=1.0, seed=1,
                                       extra_body={"grammar": 'root ::= ("yes" | "no") "."'})
    assert yes_no.choices[0].text in ("yes.", "no.") and yes_no.choices[0].finish_reason == "stop"
    digits = client.completions.create(model=MODEL, prompt="x = ", max_tokens=8, temperature=1.0, seed=2,
                                       extra_body={"guided_regex": "[0-9]{4}"})
    assert len(digits.choices[0].text) == 4 and digits.choices[0].text.isdigit()


def test_a_bad_schema_is_a_400_saying_why(client: openai.OpenAI) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": 5}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, response_format=bad)  # type: ignore[arg-type]
    assert "grammar" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", extra_body={"guided_regex": "("})


def test_responses_text_format(client: openai.OpenAI) -> None:
    r = client.responses.parse(model=MODEL, input="Describe a person as JSON.", text_format=Person,
                               temperature=1.0, max_output_tokens=120, extra_body={"seed": 4})
    assert isinstance(r.output_parsed, Person)
    events = list(client.responses.create(model=MODEL, input="Describe a place.", stream=True, max_output_tokens=120,
                                          text={"format": {"type": "json_schema", "name": "place", "schema": SCHEMA}},
                                          temperature=1.0, extra_body={"seed": 2}))
    done = [e for e in events if e.type == "response.completed"][0]
    jsonschema.validate(json.loads(done.response.output_text), SCHEMA)


def test_ollama_format(gateway: Any) -> None:
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=gateway.url)
    options = {"temperature": 1.0, "seed": 3, "num_predict": 120}
    r = client.chat(model=MODEL, messages=CHAT, format=Person.model_json_schema(), options=options)
    Person.model_validate_json(r.message.content)
    pieces = list(client.generate(model=MODEL, prompt="Answer in JSON: ", format="json", stream=True,
                                  options={"temperature": 0, "num_predict": 100}))
    assert isinstance(json.loads("".join(p.response for p in pieces)), dict)


def test_the_native_sdk(native: Any) -> None:
    text = "".join(c.text for c in native.generate("A place:", json_schema=SCHEMA, temperature=1.0, seed=7,
                                                   max_tokens=120))
    jsonschema.validate(json.loads(text), SCHEMA)
    with pytest.raises(BadRequest, match="invalid regex grammar"):
        list(native.generate("x", grammar=_grammar("regex", "(")))


def _grammar(kind: str, text: str) -> Any:
    from ember.protocol.messages import Grammar

    return Grammar(kind, text)


@pytest.mark.slow  # importing litellm takes seconds
def test_litellm_sees_a_context_overflow(gateway: Any) -> None:
    """litellm maps ember's context_length_exceeded to ContextWindowExceededError, so its fallbacks fire."""
    import os

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from the internet at import
    litellm = pytest.importorskip("litellm")
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(model=f"openai/{MODEL}", api_base=f"{gateway.url}/v1", api_key="unused",
                           messages=[{"role": "user", "content": "word " * 40000}], max_tokens=8, num_retries=0)
