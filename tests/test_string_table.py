"""daemon/loader/string_table.py: a packed table reads back exactly the strings it was given, as a
list of them would, in less memory."""
from __future__ import annotations

import sys

import pytest

from ember.daemon.loader.string_table import StringTable

WORDS = ["<|endoftext|>", "", "Ġthe", "ü" * 3, "▁日本", "[PAD7]", "a"]


def test_reads_back_as_a_list() -> None:
    table = StringTable.of(WORDS)
    assert len(table) == len(WORDS) and list(table) == WORDS
    assert [table[i] for i in range(len(WORDS))] == WORDS and table[-1] == "a" and table[-len(WORDS)] == WORDS[0]
    assert table[2:5] == WORDS[2:5] and table[::-2] == WORDS[::-2]
    assert table == WORDS and table != WORDS[:-1] and table != [*WORDS[:-1], "b"]
    assert table == StringTable.of(WORDS) and "Ġthe" in table and table.index("▁日本") == 4
    for i in (len(WORDS), -len(WORDS) - 1):
        with pytest.raises(IndexError):
            table[i]


def test_empty_table() -> None:
    table = StringTable.of([])
    assert len(table) == 0 and list(table) == [] and table == []


def test_takes_a_fraction_of_a_list() -> None:
    words = [f"Ġtoken{i}" for i in range(32000)]
    table = StringTable.of(words)
    as_list = sys.getsizeof(words) + sum(sys.getsizeof(w) for w in words)
    assert table.nbytes < as_list / 5 and list(table) == words
