"""Constrained decoding (daemon/text/grammar.py) on the trained demo model: what each kind of grammar
lets through, the matcher's masks against llguidance's own answers, and generation under a grammar on
every engine path — single steps, decode bursts, batches, speculative decoding — always giving text
that parses and follows its JSON schema (checked by jsonschema, an oracle nobody here wrote)."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

import ember
from ember.daemon.engine.engine_core import EngineCore
from ember.daemon.engine.sequence import Sequence
from ember.daemon.loader.demo_model import DEMO_DFLASH, DEMO_DRAFT, DEMO_MODEL
from ember.daemon.runner.model_runner import ModelRunner
from ember.daemon.text.grammar import GrammarError, compile_grammar
from ember.kernels.sampling import SamplingParams, allowed_tokens
from ember.kernels.sampling_batch import sample
from ember.protocol.messages import Grammar

# schemas of the kinds structured-output clients send: pydantic models' (titles, $defs, enums), nested
# arrays, optional fields, bounded integers, strings with lengths. Each bounds its answer's length: a
# JSON number's digits (or a string's length) have none in JSON Schema, and a tiny model sampling at
# temperature 1 may run them to max_tokens (its answer is then cut, reason "length", as anywhere)
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                      "percent": {"type": "integer", "minimum": 0, "maximum": 100}},
     "required": ["answer", "percent"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "minItems": 1, "maxItems": 4}},
     "required": ["tags"], "additionalProperties": False},
    {"$defs": {"Point": {"title": "Point", "type": "object", "properties": {"x": {"type": "integer", "maximum": 999},
                                                                          "y": {"type": "integer", "maximum": 999}},
                         "required": ["x", "y"], "additionalProperties": False}},
     "title": "Segment", "type": "object", "properties": {"start": {"$ref": "#/$defs/Point"},
                                                          "end": {"$ref": "#/$defs/Point"}},
     "required": ["start", "end"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 16}},
     "required": ["ok"], "additionalProperties": False},
]
PROMPTS = ["The user record:\n", "def parse(text):\n    return ", "Answer in JSON: ", "{"]


@pytest.fixture(scope="module")
def model() -> ember.Model:
    return ember.load(DEMO_MODEL)


def schema_grammar(schema: dict) -> Grammar:
    return Grammar("json_schema", json.dumps(schema))


def constrained(model: ember.Model, prompt: str, grammar: Grammar, **options) -> tuple[str, list[int]]:
    ids = list(model.generate(prompt, grammar=grammar, **options))
    return model.detokenize(ids), ids


def test_bad_grammars_say_what_is_wrong() -> None:
    cases = [("json_schema", "{nope", "not valid JSON"), ("json_schema", "[1]", "must be an object"),
             ("regex", "(", "unclosed group"), ("lark", "start: foo", "unknown name"),
             ("gbnf", "root ::= (", "GBNF"), ("choice", "[]", "non-empty strings"), ("xml", "", "one of")]
    for kind, text, why in cases:
        with pytest.raises(GrammarError, match=re.escape(why)):
            compile_grammar(kind, text)


def test_masks_follow_the_grammar_and_pending_tokens_roll_back(model) -> None:
    """A regex's first mask holds its digits only; after pending tokens (a burst's, a draft's) the mask
    is the one after them, and the matcher is back where it was; a complete grammar allows only the
    end and is done."""
    c = model.grammars.constraint(compile_grammar("regex", "[0-9]{3}!"))
    tok = model.tokenizer
    first = np.flatnonzero(allowed_tokens(c.allowed(), model.config.vocab))
    assert first.size and all(re.fullmatch(r"[0-9]{1,3}!?", tok.decode([int(t)])) for t in first)
    digits = tok.encode("123", add_special=False)
    after = allowed_tokens(c.allowed(digits), model.config.vocab)
    assert {tok.decode([int(t)]) for t in np.flatnonzero(after)} == {"!"}
    np.testing.assert_array_equal(c.allowed(), c.allowed(()))  # rolled back
    for t in digits + tok.encode("!", add_special=False):
        c.accept(t)
    assert c.done and not c.failed
    assert set(np.flatnonzero(allowed_tokens(c.allowed(), model.config.vocab))) <= set(tok.eos_ids)
    bad = model.grammars.constraint(compile_grammar("regex", "[0-9]+"))
    bad.accept(tok.encode("x", add_special=False)[0])
    assert bad.failed
    with pytest.raises(ValueError):
        bad.allowed()


def test_the_sampler_draws_only_allowed_tokens_with_their_renormalized_logprobs() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(100).astype(np.float32) * 3
    allowed = [7, 40, 41, 99]
    bits = np.zeros(128, np.uint8)
    bits[allowed] = 1
    words = np.packbits(bits, bitorder="little").view(np.int32)
    flat = np.full(100, 5.0, np.float32)  # every ruled-out token far likelier than the allowed ones
    flat[allowed] = 0.0
    drawn = {sample(flat, SamplingParams(temperature=1.0), np.random.default_rng(s), allowed=words).token
             for s in range(100)}
    assert drawn == set(allowed)
    best = sample(logits, SamplingParams(logprobs=10), rng, allowed=words)
    sub = logits[allowed].astype(np.float64)
    want = sub - sub.max() - np.log(np.exp(sub - sub.max()).sum())
    assert best.token == allowed[int(np.argmax(sub))]
    np.testing.assert_allclose(best.logprob, want.max(), rtol=1e-5)
    assert sorted(t for t, _ in best.top) == allowed  # 10 asked, 4 allowed: no ruled-out alternative
    with pytest.raises(ValueError, match="allows no token"):
        sample(logits, SamplingParams(), rng, allowed=np.zeros(4, np.int32))


@pytest.mark.parametrize("params", [dict(temperature=0.9), dict(temperature=1.2, top_k=3),
                                    dict(temperature=0.7, top_p=0.8),
                                    dict(temperature=1.0, min_p=0.1, repetition_penalty=1.3)])
def test_a_few_allowed_tokens_draw_what_the_whole_vocabulary_draws(params: dict) -> None:
    """With few tokens allowed the sampler builds the distribution over them alone: the same token as
    over the whole vocabulary with the others at -inf, draw for draw."""
    rng = np.random.default_rng(5)
    logits = rng.standard_normal(512).astype(np.float32) * 2
    allowed = rng.choice(512, 20, replace=False)
    bits = np.zeros(512, np.uint8)
    bits[allowed] = 1
    words = np.packbits(bits, bitorder="little").view(np.int32)
    ruled_out = np.where(bits.astype(bool), logits, np.float32(-np.inf))
    p = SamplingParams(**params)
    for seed in range(50):
        got = sample(logits, p, np.random.default_rng(seed), [1, 2], [int(allowed[0])], allowed=words)
        want = sample(ruled_out, p, np.random.default_rng(seed), [1, 2], [int(allowed[0])])
        assert got.token == want.token and got.token in allowed


def test_each_kind_of_grammar_holds_on_the_demo_model(model) -> None:
    cases = [(Grammar("regex", r"[a-z]{2,6}=[0-9]{1,3};"), r"[a-z]{2,6}=[0-9]{1,3};"),
             (Grammar("choice", '["alpha", "beta", "gamma"]'), r"alpha|beta|gamma"),
             (Grammar("lark", 'start: "x" NUM ("," NUM)?\nNUM: /[0-9]{1,3}/'), r"x[0-9]{1,3}(,[0-9]{1,3})?"),
             (Grammar("gbnf", 'root ::= "(" [a-c]{1,5} ")"'), r"\([a-c]{1,5}\)")]
    for grammar, pattern in cases:
        for seed in range(3):
            text, _ = constrained(model, PROMPTS[seed], grammar, max_tokens=40, temperature=1.0, seed=seed)
            assert re.fullmatch(pattern, text), (grammar.kind, text)
    # any JSON object: no bound on its length, so a prompt the tiny model closes greedily
    text, _ = constrained(model, "Answer in JSON: ", Grammar("json"), max_tokens=100)
    assert isinstance(json.loads(text), dict) and len(json.loads(text)) > 1


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_sampled_json_always_follows_its_schema(model, schema: dict) -> None:
    """At temperature 1.0 the tiny model writes anything it likes; under the schema's grammar every
    answer still parses and validates, and ends by itself (stop), not at max_tokens."""
    for seed in range(4):
        text, _ = constrained(model, PROMPTS[seed % len(PROMPTS)], schema_grammar(schema), max_tokens=200,
                              temperature=1.0, seed=seed)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.slow
def test_200_sampled_completions_against_5_schemas_all_valid(model) -> None:
    """The acceptance count: 40 seeds x 5 schemas at temperature 1.0, every one valid."""
    invalid = []
    for schema in SCHEMAS:
        for seed in range(40):
            text, _ = constrained(model, PROMPTS[seed % len(PROMPTS)], schema_grammar(schema), max_tokens=300,
                                  temperature=1.0, seed=100 + seed)
            try:
                jsonschema.validate(json.loads(text), schema)
            except (ValueError, jsonschema.ValidationError) as e:
                invalid.append((text, str(e)))
    assert not invalid, invalid[:3]


def engine(model: ember.Model, **options) -> EngineCore:
    return EngineCore(ModelRunner(model.net, 64, 16), grammars=model.grammars, **options)


def run(engine: EngineCore, seqs: list[Sequence]) -> None:
    for seq in seqs:
        engine.add(seq)
    while engine.has_work:
        engine.step()


def test_bursts_and_batches_give_the_tokens_of_single_steps(model) -> None:
    """Decode bursts sample several tokens before the engine keeps them: each one's mask is taken after
    the burst's tokens before it, so a batch of constrained and free sequences gets exactly the
    tokens single steps give, and the grammar ends its sequence in mid-burst."""
    grammar = compile_grammar("json_schema", json.dumps(SCHEMAS[0]))

    def sequences() -> list[Sequence]:
        prompts = [model.tokenize(p) for p in PROMPTS]
        return [Sequence(p, 80, SamplingParams(temperature=1.0, repetition_penalty=1.1), seed=i,
                         stop_ids=frozenset(model.tokenizer.eos_ids), grammar=grammar if i % 2 == 0 else None)
                for i, p in enumerate(prompts)]

    single, burst = sequences(), sequences()
    run(engine(model), single)
    bursting = engine(model, decode_burst=float("inf"), max_burst=6)
    run(bursting, burst)
    assert [s.generated for s in burst] == [s.generated for s in single]
    for s in burst[::2]:
        assert s.finish_reason == "stop"
        jsonschema.validate(json.loads(model.detokenize(s.generated)), SCHEMAS[0])
    assert bursting.stats().kv_blocks_free == 64


@pytest.mark.parametrize("draft", [DEMO_DRAFT, DEMO_DFLASH], ids=["draft-model", "dflash"])
def test_speculative_decoding_under_a_grammar(model, draft) -> None:
    """Drafts (a draft model's, a feature-conditioned draft's) are proposed under the grammar and verified
    under it: greedy gives the tokens of decoding without a draft, with proposals accepted; sampled
    answers follow the schema."""
    spec = ember.load(DEMO_MODEL, draft=draft, draft_tokens=4)
    grammar = schema_grammar(SCHEMAS[3])
    for prompt in PROMPTS[:2]:
        want = constrained(model, prompt, grammar, max_tokens=120)
        assert constrained(spec, prompt, grammar, max_tokens=120) == want
        jsonschema.validate(json.loads(want[0]), SCHEMAS[3])
    assert spec.spec_stats().accepted > 0
    for seed in range(4):
        text, _ = constrained(spec, PROMPTS[seed], schema_grammar(SCHEMAS[2]), max_tokens=150, temperature=1.0,
                              seed=seed)
        jsonschema.validate(json.loads(text), SCHEMAS[2])


def test_an_engine_without_grammars_refuses_a_constrained_sequence(model) -> None:
    bare = EngineCore(ModelRunner(model.net, 8, 16))
    with pytest.raises(ValueError, match="no grammars"):
        bare.add(Sequence([1, 2], 4, grammar=compile_grammar("json", "")))


def test_the_cli_options_name_a_grammar(tmp_path) -> None:
    from ember.client.cli.main import build_parser
    from ember.client.cli.sampling_options import grammar_of

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMAS[0]))
    gbnf = tmp_path / "g.gbnf"
    gbnf.write_text('root ::= "yes" | "no"')
    cases = [([], None), (["--json-schema", "{}"], Grammar("json")), (["--json-schema", f"@{schema}"],
             Grammar("json_schema", json.dumps(SCHEMAS[0]))), (["--regex", "[0-9]+"], Grammar("regex", "[0-9]+")),
             (["--grammar", str(gbnf)], Grammar("gbnf", 'root ::= "yes" | "no"'))]
    for options, grammar in cases:
        assert grammar_of(build_parser().parse_args(["run", *options, "hi"])) == grammar
    with pytest.raises(SystemExit):  # one grammar at a time
        build_parser().parse_args(["run", "--regex", "a", "--json-schema", "{}", "hi"])


def test_a_greedy_rows_allowed_argmax_is_the_masked_argmax(model, monkeypatch) -> None:
    """A greedy row under a grammar first tries its plain argmax (allowed: it is the masked argmax too,
    no mask computed); the tokens equal those of computing every mask."""
    from ember.daemon.runner import row_sampler

    calls = []
    real = row_sampler.RowSampler._grammar_argmax

    def counted(self, *args):  # type: ignore[no-untyped-def]
        found = real(self, *args)
        calls.append(len(found))
        return found

    grammar = schema_grammar(SCHEMAS[3])
    monkeypatch.setattr(row_sampler.RowSampler, "_grammar_argmax", counted)
    fast = [constrained(model, p, grammar, max_tokens=120)[1] for p in PROMPTS]
    monkeypatch.setattr(row_sampler.RowSampler, "_grammar_argmax", lambda self, *args: {})
    masked = [constrained(model, p, grammar, max_tokens=120)[1] for p in PROMPTS]
    assert fast == masked
    assert 0 < sum(calls) < sum(len(t) for t in fast)  # most tokens by their argmax, some by the mask
