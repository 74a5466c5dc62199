"""The built-in demo model chats out of the box: its GGUF carries a ChatML template
(daemon/assets/README.md), rendered as transformers renders it, and `ember chat` against a daemon
serving the demo answers. A model without a template still gets a clear BadRequest."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from daemon_process import DaemonProcess
from ember.client import Client
from ember.client.errors import BadRequest
from ember.daemon.loader.demo_model import DEMO_MODEL
from gguf_copy import copy_gguf
from tiny_models import DEMO_TOKENIZER

pytestmark = pytest.mark.slow

CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."},
        {"role": "assistant", "content": "sorted(xs)"}, {"role": "user", "content": "In place?"}]
RENDERED = ("<|im_start|>system\nYou write Python.<|im_end|>\n<|im_start|>user\nSort a list.<|im_end|>\n"
            "<|im_start|>assistant\nsorted(xs)<|im_end|>\n<|im_start|>user\nIn place?<|im_end|>\n"
            "<|im_start|>assistant\n")


def test_demo_model_renders_chatml(demo_model: Any) -> None:
    assert demo_model.render_chat(CHAT) == RENDERED
    assert demo_model.render_chat(CHAT, add_generation_prompt=False) == RENDERED.removesuffix("<|im_start|>assistant\n")
    assert demo_model.chat_ids(CHAT) == demo_model.tokenize(RENDERED, add_special=False)


def test_demo_template_renders_as_transformers_does(demo_model: Any) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(DEMO_TOKENIZER / "tokenizer.json"),
                                              bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    for prompt in (True, False):
        expected = hf.apply_chat_template(CHAT, chat_template=demo_model.tokenizer.chat_template, tokenize=False,
                                          add_generation_prompt=prompt)
        assert demo_model.render_chat(CHAT, add_generation_prompt=prompt) == expected


def test_client_chat_with_the_demo_gives_a_completion(daemon) -> None:  # type: ignore[no-untyped-def]
    with Client(daemon.socket) as client:
        assert [m.chat_template for m in client.models()] == [True]
        stream = client.chat(CHAT, max_tokens=8, ignore_eos=True, temperature=0.0)
        text = stream.text()
    assert stream.finished is not None and stream.finished.reason == "length"
    assert stream.finished.usage.completion_tokens == 8 and text


def test_ember_chat_command_answers(daemon) -> None:  # type: ignore[no-untyped-def]
    done = subprocess.run([sys.executable, "-m", "ember.client.cli", "chat", "--socket", str(daemon.socket),
                           "--max-tokens", "8", "--seed", "0"], input="Write a function.\n", capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "error" not in done.stderr and done.stdout.startswith("> ") and done.stdout.strip("> \n")


def without_template(path: Path) -> Path:
    """A copy of the demo model without its chat template (every other key and tensor as they are)."""
    return copy_gguf(DEMO_MODEL, path, drop=["tokenizer.chat_template"])


def test_chat_with_a_model_without_template_is_a_bad_request(tmp_path: Path) -> None:
    model = without_template(tmp_path / "plain.gguf")
    d = DaemonProcess(f'[[models]]\npath = "{model}"\n[engine]\nwarmup = false\n').wait_ready()
    try:
        with Client(d.socket) as client:
            assert [m.chat_template for m in client.models()] == [False]
            with pytest.raises(BadRequest, match="no chat template"):
                client.chat([{"role": "user", "content": "hi"}]).text()
            stream = client.generate("def f", max_tokens=2, ignore_eos=True)  # and a plain prompt still works
            stream.text()
            assert stream.finished is not None and stream.finished.usage.completion_tokens == 2
    finally:
        assert d.stop() == 0
