"""One client's request cannot end another's: the sampling values that used to poison a whole batch
(found by fuzzing a live daemon) are refused or computed safely while a bystander streams beside them."""
from __future__ import annotations

import threading

import pytest

from ember.client import Client
from ember.client.errors import BadRequest

pytestmark = pytest.mark.slow

PROMPT = "def fibonacci(n):"

ACCEPTED = [dict(temperature=1e-310), dict(temperature=4e-312, min_p=7e-322), dict(temperature=5e-324, top_p=5e-324),
            dict(temperature=1.0, repetition_penalty=0.01, frequency_penalty=-2.0, presence_penalty=-2.0)]
REFUSED = [dict(temperature=1.0, repetition_penalty=1e-310), dict(temperature=0.5, frequency_penalty=-6.5e91),
           dict(temperature=float("nan")), dict(top_p=float("inf")), dict(temperature=1e300)]


def test_poisonous_sampling_values_do_not_touch_a_bystander(daemon, demo_model) -> None:  # type: ignore[no-untyped-def]
    expected = list(demo_model.generate(PROMPT, max_tokens=300, ignore_eos=True))
    got: list[int] = []

    def bystander() -> None:
        with Client(daemon.socket) as client:
            stream = client.generate(PROMPT, max_tokens=300, ignore_eos=True)
            got.extend(t for chunk in stream for t in chunk.token_ids)
            assert stream.finished is not None and stream.finished.reason == "length"

    thread = threading.Thread(target=bystander)
    thread.start()
    with Client(daemon.socket) as client:
        for options in ACCEPTED:  # computed safely: a tiny temperature is greedy
            stream = client.generate(PROMPT, max_tokens=8, seed=3, **options)
            assert len([t for c in stream for t in c.token_ids]) == 8 and stream.finished.reason == "length"
        for options in REFUSED:
            with pytest.raises(BadRequest):
                client.generate(PROMPT, max_tokens=8, **options).text()
    thread.join(120)
    assert got == expected
