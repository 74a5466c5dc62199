"""Stop strings across token boundaries."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ember.daemon.text.stop_strings import StopStrings


def stream(deltas: list[str], stops: list[str]) -> tuple[str, bool]:
    s = StopStrings(stops)
    out = "".join(s.feed(d) for d in deltas)
    return out + s.flush(), s.stopped


def test_stop_split_over_tokens() -> None:
    assert stream(["Hello", " wo", "rld", "\n\nnext"], ["\n\n"]) == ("Hello world", True)
    assert stream(["ab", "c<", "/e", "nd>tail"], ["</end>"]) == ("abc", True)


def test_held_text_released_when_not_a_stop() -> None:
    s = StopStrings(["STOP"])
    assert s.feed("xx ST") == "xx "
    assert s.feed("AR") == "STAR"
    assert s.flush() == "" and not s.stopped
    assert stream(["ST"], ["STOP"]) == ("ST", False)


def test_earliest_of_several_stops_wins() -> None:
    assert stream(["a b c d"], ["c", " b"]) == ("a", True)


def test_a_found_stop_waits_for_a_longer_one_that_starts_before_it() -> None:
    """In "\na" the stop "a" is found, but "\naa" starts earlier and may still complete: the next
    delta decides (hypothesis found this one)."""
    assert stream(["\na", "a"], ["a", "\naa"]) == ("", True)
    assert stream(["\na", "b"], ["a", "\naa"]) == ("\n", True)
    assert stream(["\na"], ["a", "\naa"]) == ("\n", True)  # the end decides: no more text comes


@given(st.text(alphabet="ab\n", max_size=30), st.lists(st.integers(0, 30), max_size=6),
       st.lists(st.text(alphabet="ab\n", min_size=1, max_size=3), min_size=1, max_size=2))
def test_any_split_equals_whole_text(text: str, cuts: list[int], stops: list[str]) -> None:
    points = sorted({min(c, len(text)) for c in cuts})
    deltas = [text[a:b] for a, b in zip([0] + points, points + [len(text)])]
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    expected = (text[: min(hits)], True) if hits else (text, False)
    assert stream(deltas, stops) == expected
