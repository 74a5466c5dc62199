"""The sampling options of `ember run`, `ember generate` and `ember chat`, and the grammar their text may
be held to (--json-schema, --regex, --grammar)."""
from __future__ import annotations

import argparse
from pathlib import Path

from ember.protocol.messages import Grammar


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    """The sampling options a left out option leaves to the model's recommendation (its file's, else
    llama.cpp's: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05); --temperature 0 is greedy (over a repetition
    penalty the model recommends; --repetition-penalty 1 for none)."""
    p.add_argument("--temperature", type=float, help="0 = greedy (default: the model's recommendation)")
    p.add_argument("--top-k", type=int, help="sample among the k best tokens, 0 = all (default: the model's)")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass (default: the model's)")
    p.add_argument("--min-p", type=float, help="drop tokens below min_p x the best probability (default: the model's)")
    p.add_argument("--repetition-penalty", type=float,
                   help="llama.cpp-style multiplicative penalty, 1 = off (default: the model's)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="SCHEMA", help="the text is JSON following this schema (JSON text, or "
                   "@FILE); {} for any JSON object")
    g.add_argument("--regex", help="the text matches this regular expression")
    g.add_argument("--grammar", metavar="FILE", help="the text follows this grammar file (GBNF or Lark)")


def grammar_of(args: argparse.Namespace) -> Grammar | None:
    """The grammar the options ask for (None: free text)."""
    if args.json_schema is not None:
        text = args.json_schema
        text = Path(text[1:]).read_text() if text.startswith("@") else text
        return Grammar("json") if text.strip() == "{}" else Grammar("json_schema", text)
    if args.regex is not None:
        return Grammar("regex", args.regex)
    if args.grammar is not None:
        return Grammar("gbnf", Path(args.grammar).read_text())  # llguidance reads GBNF and Lark alike
    return None
