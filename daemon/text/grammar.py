"""Constrained decoding: a request's grammar (a JSON schema, any JSON object, a regular expression, a
Lark or GBNF grammar) as the set of tokens that may come next, applied by every sampler as a mask
(kernels/sampling.py, step 0).

llguidance does the work (the library llama.cpp and vLLM use): a grammar compiles in milliseconds with
no per-vocabulary precomputation, and a mask over 8k tokens costs ~7 us (benchmarks/gateway.py measures
it per token). xgrammar, the other candidate, precompiles per grammar and requires torch, transformers
and triton (xgrammar 0.2.9's wheel), none of which the daemon otherwise needs.

Two halves, one per process:
- the front checks a request's grammar (`compile_grammar`, no vocabulary needed) and sends llguidance's
  grammar text on with the sequence; a bad grammar is the request's 400, never the engine's problem;
- the engine keeps one `Grammars` per model (llguidance's view of the vocabulary, built on the first
  constrained request) and gives each constrained sequence a `GrammarConstraint`: the matcher it
  advances with every token the sequence keeps, which samplers ask for masks
  (step/row_sampling.TokenConstraint).
The parser's work per token is bounded by llguidance's limits (lexer fuel, Earley items), so no grammar
stalls the engine loop for long; one that runs out puts its own sequence in error.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import llguidance
import numpy as np

from ember.daemon.text.tokenizer import Tokenizer

KINDS = ("json_schema", "json", "regex", "choice", "lark", "gbnf")
# JSON: whitespace between items is limited (llguidance's default is any run of it, which a small model
# at temperature 1 can fill its whole budget with, so that the answer never closes)
JSON_OPTIONS: dict[str, Any] = {"whitespace_pattern": r"[ \n]{0,4}"}
ANY_JSON_OBJECT = '{"type": "object"}'


class GrammarError(ValueError):
    """A grammar that cannot be used, and why (one line, fit for a 400)."""


def compile_grammar(kind: str, text: str) -> str:
    """llguidance's grammar text for `text` of `kind` (KINDS; "json": any JSON object, text unused;
    "choice": a JSON list of the strings allowed), checked; GrammarError says what is wrong with it."""
    if kind not in KINDS:
        raise GrammarError(f"grammar kind must be one of {', '.join(KINDS)}, got {kind!r}")
    try:
        if kind in ("json_schema", "json"):
            schema = json.loads(ANY_JSON_OBJECT if kind == "json" else text)
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("a JSON schema must be an object")
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        elif kind == "choice":
            choices = json.loads(text)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                raise GrammarError("a choice grammar is a JSON list of non-empty strings")
            grammar = llguidance.grammar_from("choice", choices)
        else:
            grammar = llguidance.grammar_from(kind, text)  # gbnf: llguidance's converter to Lark first
    except GrammarError:
        raise
    except json.JSONDecodeError as e:
        raise GrammarError(f"the {kind} grammar is not valid JSON: {e}") from None
    except ValueError as e:
        raise GrammarError(f"invalid {kind} grammar: {e}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(f"invalid {kind} grammar: {messages[0]}")
    return grammar


class Grammars:
    """One model's grammars: llguidance's tokenizer over its vocabulary, and a matcher per sequence."""

    def __init__(self, tokenizer: Tokenizer, vocab: int) -> None:
        """vocab: the model's logits width (a mask has a bit for each, tokens past the tokenizer's never set)."""
        self.tokenizer, self.vocab = tokenizer, vocab
        self._lock = threading.Lock()
        self._ll: llguidance.LLTokenizer | None = None

    def constraint(self, grammar: str) -> GrammarConstraint:
        """A fresh matcher of `grammar` (compile_grammar's text); GrammarError if llguidance refuses it."""
        matcher = llguidance.LLMatcher(self._llguidance(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid grammar: {matcher.get_error()}")
        return GrammarConstraint(matcher, -(-self.vocab // 32))

    def _llguidance(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = _ll_tokenizer(self.tokenizer, self.vocab)
            return self._ll


class GrammarConstraint:
    """One sequence's matcher (step/row_sampling.TokenConstraint).

    The matcher may run ahead of the tokens the sequence kept: a mask after pending tokens consumes
    them and stays there, so that a decode burst, whose pending tokens grow by one a step, consumes
    each token once; pending tokens that turn out otherwise (a draft's, a verification's) are rolled
    back, and so are the ones still ahead when the engine asks whether the grammar is complete."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int) -> None:
        self._m, self._words = matcher, words
        self._ahead: list[int] = []  # consumed past the accepted tokens

    def allowed(self, pending: Sequence[int] = ()) -> np.ndarray:
        m = self._m
        if m.is_error():
            raise ValueError(m.get_error())
        self._follow(pending)
        out = np.empty(self._words, np.int32)
        m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        if m.is_error():
            raise ValueError(m.get_error())
        return out

    def allows(self, token: int, pending: Sequence[int] = ()) -> bool:
        m = self._m
        if m.is_error():
            return False
        self._follow(pending)
        return bool(m.validate_tokens([token]))

    def accept(self, token: int) -> None:
        if self._ahead and self._ahead[0] == token:  # consumed already, while it was pending
            del self._ahead[0]
            return
        self._back()
        self._m.consume_token(token)  # a refused token puts the matcher in error, which `failed` reports

    @property
    def done(self) -> bool:
        self._back()
        return self._m.is_stopped()

    @property
    def failed(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""

    def _follow(self, pending: Sequence[int]) -> None:
        """The matcher after the accepted tokens and `pending`: what it shares with the tokens ahead is
        kept, the rest of those rolled back, the rest of `pending` consumed."""
        same = 0
        for a, b in zip(self._ahead, pending):
            if a != b:
                break
            same += 1
        if same < len(self._ahead):
            self._m.rollback(len(self._ahead) - same)
            del self._ahead[same:]
        rest = list(pending[same:])
        if rest:
            n = self._m.try_consume_tokens(rest)
            self._ahead += rest[:n]
            if n < len(rest) and not self._m.is_stopped():  # past a stop only an end follows; else a bug
                raise ValueError(f"token {rest[n]} does not follow the grammar")

    def _back(self) -> None:
        if self._ahead:
            self._m.rollback(len(self._ahead))
            self._ahead.clear()


def _ll_tokenizer(tokenizer: Tokenizer, vocab: int) -> llguidance.LLTokenizer:
    """llguidance's view of the vocabulary: a Hugging Face tokenizer.json as it is; a GGUF vocabulary
    as each token's bytes, control tokens marked special (a leading 0xff byte, llguidance's convention)
    so that grammars name them (<|im_end|>) and never spell them as text."""
    eos = sorted(tokenizer.eos_ids) or None
    pieces = tokenizer.pieces()
    if pieces is None:
        return llguidance.LLTokenizer(tokenizer.core.to_str(), n_vocab=vocab, eos_token=eos)
    tokens = [b"\xff" + piece if control else piece for piece, control in pieces]
    tokens += [b""] * (vocab - len(tokens))
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer, tokens)), n_vocab=vocab,
                                  eos_token=eos)


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads of a tokenizer."""

    def __init__(self, tokenizer: Tokenizer, tokens: list[bytes]) -> None:
        self._tokenizer = tokenizer
        self.tokens = tokens
        self.eos_token_id, self.bos_token_id = tokenizer.eos_id, tokenizer.bos_id
        self.special_token_ids: list[int] = []

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", "replace"), add_special=False, parse_special=False)
