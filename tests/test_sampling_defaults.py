"""A model's recommended sampling (daemon/text/sampling_defaults.py): read from each source — a GGUF
file's general.sampling.* keys, a Hugging Face directory's generation_config.json, else llama.cpp's
defaults — and what a request that leaves a parameter out (None) gets from the daemon and the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from ember.client.cli.main import build_parser
from ember.client.cli.daemon_commands import _options
from ember.daemon.loader.demo_model import DEMO_MODEL
from ember.daemon.server.request import request_from_generate
from ember.daemon.text.sampling_defaults import LLAMA_CPP_SOURCE, SamplingDefaults, from_gguf, from_hf_dir
from ember.daemon.text.text_model import open_text_model
from ember.protocol.limits import Limits
from ember.protocol.messages import Generate
from gguf_copy import copy_gguf

LLAMA_CPP = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.0}
DEMO = {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.2}  # daemon/assets/README.md


def test_without_a_recommendation_llama_cpps_defaults() -> None:
    assert SamplingDefaults().as_dict() == LLAMA_CPP


def test_the_demo_recommends_its_own_sampling() -> None:
    """daemon/assets/README.md: llama.cpp's defaults made the demo loop ("fibonacci(fibonacci(..."); its
    file names settings measured to write code, each read back as written."""
    demo = open_text_model(DEMO_MODEL).sampling
    assert demo.as_dict() == DEMO
    assert LLAMA_CPP_SOURCE not in demo.sources.values()


def test_gguf_keys_override_each_parameter_they_name() -> None:
    got = from_gguf({"general.sampling.temp": 0.6, "general.sampling.top_k": 20, "general.sampling.min_p": 0.0,
                     "general.sampling.penalty_repeat": 1.1, "general.sampling.top_p": 7.0})  # out of range: ignored
    assert got.as_dict() == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0, "repetition_penalty": 1.1}
    assert got.sources["temperature"] == "general.sampling.temp" and got.sources["top_p"] == LLAMA_CPP_SOURCE


def test_a_gguf_file_written_with_the_keys_is_read_through_the_text_model(tmp_path: Path) -> None:
    path = copy_gguf(DEMO_MODEL, tmp_path / "recommends.gguf", drop=[f"general.sampling.{k}" for k in (
        "temp", "top_k", "top_p", "min_p", "penalty_repeat")], add={
        "general.sampling.temp": (0.7, gguf.GGUFValueType.FLOAT32),
        "general.sampling.top_k": (20, gguf.GGUFValueType.INT32)})
    got = open_text_model(path).sampling
    assert (got.temperature, got.top_k, got.top_p) == (0.7, 20, 0.95)  # 0.7 as written, not its float32


def test_generation_config_json_and_do_sample_false(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20}))
    got = from_hf_dir(tmp_path)
    assert got.as_dict() == {**LLAMA_CPP, "temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert got.sources["top_p"] == "generation_config.json" and got.sources["min_p"] == LLAMA_CPP_SOURCE
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert from_hf_dir(tmp_path).temperature == 0.0  # transformers decodes greedily then
    (tmp_path / "generation_config.json").write_text("{not json")
    assert from_hf_dir(tmp_path).as_dict() == LLAMA_CPP
    assert from_hf_dir(tmp_path / "missing").as_dict() == LLAMA_CPP


@pytest.mark.parametrize("given, want", [
    ({}, dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)),  # the wire's own: greedy
    (dict(temperature=None, top_k=None, top_p=None, min_p=None, repetition_penalty=None), DEMO),
    (dict(temperature=None, top_k=5), {"temperature": 0.8, "top_k": 5}),
])
def test_the_daemon_fills_what_a_request_leaves_to_the_model(given: dict, want: dict) -> None:
    model = open_text_model(DEMO_MODEL)
    request = request_from_generate(b"c", Generate(1, prompt="x", **given), {"demo": model}, Limits())
    assert {name: getattr(request.params, name) for name in want} == want


def test_the_commands_leave_sampling_to_the_model_unless_asked() -> None:
    parser = build_parser()
    args = parser.parse_args(["generate", "hi"])
    assert all(_options(args)[k] is None for k in LLAMA_CPP)
    args = parser.parse_args(["generate", "hi", "--temperature", "0"])
    assert _options(args)["temperature"] == 0.0
    run = parser.parse_args(["run", "hi"])
    assert run.temperature is None and run.top_k is None
