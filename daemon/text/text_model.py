"""TextModel: the text side of one model file — its config, tokenizer, chat template and recommended
sampling, without its weights. The daemon's front process serves tokenizing, chat rendering and validation from it while
the engine process holds the weights; `Model` (daemon/runtime.py) is a TextModel with weights."""
from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ember.daemon.loader.model_config import ModelConfig
from ember.daemon.loader.model_file import ModelFile, open_model_file
from ember.daemon.loader.model_file_error import ModelFileError
from ember.daemon.text.chat_template import ChatTemplate, ChatTemplateError
from ember.daemon.text.grammar import Grammars
from ember.daemon.text.tool_format import tool_format
from ember.daemon.text.sampling_defaults import SamplingDefaults, from_gguf, from_hf_dir
from ember.daemon.text.tokenizer import Tokenizer, TokenizerError


class TextModel:
    def __init__(self, path: Path, config: ModelConfig, tokenizer: Tokenizer,
                 sampling: SamplingDefaults | None = None) -> None:
        self.path = path
        self.config = config
        self.tokenizer = tokenizer
        self.sampling = sampling or SamplingDefaults()  # what a request that names no sampling gets
        self._chat: ChatTemplate | None = None

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Its grammars for constrained decoding (llguidance's vocabulary is built on the first use)."""
        return Grammars(self.tokenizer, self.config.vocab)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids))

    @functools.cached_property
    def tool_format(self) -> str:
        """How its chat template has it write tool calls (daemon/text/tool_format.py; "": no tools)."""
        return tool_format(self.tokenizer.chat_template)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text for chat `messages`, by the model's own chat template (with `tools`, OpenAI's
        function definitions, where given)."""
        if self._chat is None:
            source = self.tokenizer.chat_template
            if source is None:
                raise ChatTemplateError(f"{self.path}: the model has no chat template")
            t = self.tokenizer
            name = lambda i: "" if i is None else t.decode([i])  # noqa: E731
            self._chat = ChatTemplate(source, name(t.bos_id), name(t.eos_id))
        return self._chat.render(messages, add_generation_prompt, **({"tools": list(tools)} if tools else {}))

    def chat_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of the rendered chat (the template writes BOS itself where the model wants it)."""
        return self.tokenizer.encode(self.render_chat(messages), add_special=False)


def tokenizer_of(mf: ModelFile) -> Tokenizer:
    """The file's tokenizer; ModelFileError (naming the file) if it has none ember can use."""
    try:
        return Tokenizer.from_gguf(mf.metadata) if mf.format == "gguf" else Tokenizer.from_hf_dir(mf.path)
    except TokenizerError as e:
        raise ModelFileError(str(mf.path), str(e)) from None


def sampling_of(mf: ModelFile) -> SamplingDefaults:
    """The file's recommended sampling (daemon/text/sampling_defaults.py)."""
    return from_gguf(mf.metadata) if mf.format == "gguf" else from_hf_dir(mf.path)


def open_text_model(path: str | Path) -> TextModel:
    """The text side of the model at `path` (a GGUF file or HF directory): its header and tokenizer
    are read, its weights stay on disk."""
    mf = open_model_file(path)
    return TextModel(mf.path, mf.config, tokenizer_of(mf), sampling_of(mf))
