"""Tokenizer: text <-> token ids exactly as the model file defines them.

GGUF vocabularies (`tokenizer.ggml.*`) are rebuilt as a `tokenizers` BPE model so that ids equal
llama.cpp's (src/llama-vocab.cpp):
- `gpt2`: byte-level BPE over the words that the pre-tokenizer regexes llama.cpp uses for the file's
  `tokenizer.ggml.pre` cut the text into (PRE_TOKENIZERS lists the values supported);
- `gemma4`: BPE over the text's characters (not bytes) with "▁" for spaces, on each line and each run of
  newlines apart (a run that is a token is that token), byte tokens <0xXX> for what no token covers;
- `llama`: SentencePiece BPE as llama.cpp runs it: from the text's characters, tokens or not, the pair
  whose merged piece has the best score merges first (merges ranked by that score), "▁" for spaces, a
  space before text at the start and after each special token, byte tokens <0xXX> for characters that are
  no token and are left unmerged.
Special tokens (control, user-defined, unknown) are cut out of the text first, longest first over the
whole text, as llama.cpp does; the BPE never sees them. Decoding joins each token's bytes, as llama.cpp's
token_to_piece does.

Hugging Face directories use their tokenizer.json as it is (added tokens, normalizer, post-processor
included), so ids and text equal transformers'.
"""
from __future__ import annotations

import functools
import gc
import json
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Regex, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as CoreTokenizer

from ember.daemon.heap import release_free_heap
from ..loader.string_table import StringTable


class TokenizerError(ValueError):
    """The file's tokenizer is missing or cannot be built (one line, fit to show as is)."""


# --- llama.cpp's pre-tokenizers, by tokenizer.ggml.pre -----------------------------------------------
@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp cuts text into words before BPE for one kind of vocabulary."""

    regexes: tuple[str, ...]  # applied in turn, each cutting the pieces the one before left
    ignore_merges: bool = False  # a word that is a token as a whole is not merged (Llama 3)
    add_bos: bool = False  # llama.cpp's add_bos when the file has no tokenizer.ggml.add_bos_token


_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_SEED_CODER = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)"
               r"|\s+")
_PORO = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"  # … 。 ， 、 । ۔ ،
# llama.cpp runs a regex without \p{..} classes on the text with each non-ASCII space made "\v" (the \s of
# std::wregex knows ASCII ones only), so no space ever falls in a [...] range there: `&&\S` takes them out
# of the ranges here (U+0800-U+4E00 holds U+1680, U+2000-U+200A, U+2028, U+2029, U+202F, U+205F, U+3000)
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff&&\\S]+"
_DEEPSEEK3 = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's rewrite of the \p{Lu}/\p{Ll} classes of Mistral's and GPT-4o's regexes: "a letter but not
# a-z" / "a letter but not A-Z" (std::regex has no such classes); kept as llama.cpp runs them
_UPPER, _LOWER = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BAILING = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]|\s+(?!\S)|\s+")
_EXAONE_MOE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+")
# DeepSeek LLM's: newlines; cased letters (Unicode's Lu, Ll, Lt, spelled out as its tokenizer.json and
# llama.cpp write them); printable ASCII but digits, and CJK punctuation (but U+3000, a space: see
# _CJK_HANGUL); spaces at the end; CJK and Hangul; digits
_CASED_LETTERS = ("A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376"
                  "\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
                  "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
                  "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
                  "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
                  "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
                  "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
                  "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
                  "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
                  "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
                  "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943")
_DEEPSEEK_LLM = ("[\r\n]", f"\\s?[{_CASED_LETTERS}]+",
                 "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002&&\\S]+", "\\s+$", _CJK_HANGUL,
                 r"\p{N}+")
_MINICPM5 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

_PRE_GROUPS: list[tuple[tuple[str, ...], PreTokenizer]] = [
    (("default",), PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))),
    (("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4", "a.x-4.0", "mellum",
      "gigachat"), PreTokenizer((_GPT2,))),
    (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
     PreTokenizer((r"\p{N}", _GPT2))),
    (("falcon",), PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"))),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
     PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)),
    (("dbrx", "smaug-bpe", "chatglm-bpe", "glm4"), PreTokenizer((_LLAMA3,))),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open", "grok-2"),
     PreTokenizer((_QWEN2,))),
    (("qwen35",), PreTokenizer((_QWEN35,))),
    (("seed-coder",), PreTokenizer((_SEED_CODER,))),
    (("poro-chat", "bloom", "gpt3-finnish"), PreTokenizer((_PORO,))),
    (("viking",), PreTokenizer((_PORO, r"\p{N}"))),
    (("deepseek-coder",), PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"))),
    (("deepseek-llm",), PreTokenizer(_DEEPSEEK_LLM)),
    (("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), PreTokenizer(_DEEPSEEK3)),
    (("tekken",), PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True)),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), PreTokenizer((_GPT4O,))),
    (("bailingmoe", "bailingmoe2", "llada-moe"), PreTokenizer((_BAILING,))),
    (("exaone-moe",), PreTokenizer((_EXAONE_MOE,))),
    (("laguna",), PreTokenizer((r"[^\n]+|[\n]+", _QWEN2))),
    (("minicpm5",), PreTokenizer((r"\p{N}{1,3}", _MINICPM5), ignore_merges=True)),
]
PRE_TOKENIZERS: dict[str, PreTokenizer] = {name: pre for names, pre in _PRE_GROUPS for name in names}

# GGUF token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Tokens llama.cpp treats as control tokens and as end of generation by their text alone, whatever type
# the file gives them (llama_vocab::impl::load: EOT, EOM and the EOG list).
_EOG_NAMES = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
})
# fill-in-the-middle pad/repo/file-separator tokens, which llama.cpp also counts as end of generation
_FIM_EOG_NAMES = (("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
                  ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
                  ("<|file_sep|>",))
# gpt-oss: llama.cpp always writes these out, and always parses them (user-defined)
_ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


# --- the tokenizer -----------------------------------------------------------------------------------
class Tokenizer:
    """Encode/decode for one model. Build it with from_gguf or from_hf_dir."""

    def __init__(self, core: CoreTokenizer | None, *, bos_id: int | None, eos_id: int | None, eos_ids: Iterable[int],
                 add_bos: bool, add_eos: bool, chat_template: str | None, vocab_size: int,
                 gguf: _GgufVocab | None = None) -> None:
        self._hf_core = core  # HF: tokenizer.json (GGUF: None, the vocabulary builds its BPE)
        self.bos_id, self.eos_id = bos_id, eos_id
        self.eos_ids = frozenset(eos_ids)  # EOS plus every end-of-turn token the file names
        self.add_bos, self.add_eos = add_bos, add_eos
        self.chat_template = chat_template
        self.vocab_size = vocab_size
        self._gguf = gguf
        self._literal_core: CoreTokenizer | None = None  # HF: a copy that leaves special tokens as text

    # --- construction ---------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """From GGUF metadata as `{f.name: f.contents() for f in GGUFReader(path).fields.values()}`."""
        kind, tokens, table, types = _read_vocabulary(meta)
        if kind in ("gpt2", "gemma4"):  # what the BPE is built from is checked here, the BPE built on the first encode
            add_bos = kind == "gemma4" or _pre_tokenizer(meta.get("tokenizer.ggml.pre")).add_bos
            bos, eos = None, None
            _merge_list(meta)
        else:  # with llama.cpp's defaults for SentencePiece files
            _read_numbers(meta, "tokenizer.ggml.scores", len(tokens), 0.0, float)
            add_bos, bos, eos = True, 1, 2
        bos, eos = _token_id(meta, "bos", len(tokens), bos), _token_id(meta, "eos", len(tokens), eos)
        add_bos, add_eos = _add_flags(meta, add_bos, bos, eos)
        add_bos = add_bos or kind == "gemma4"  # llama.cpp overrides a gemma4 file's false (its PR 21500)
        eog = _end_of_generation_ids(meta, tokens, eos)
        _drop_message_ends(tokens, types, eog)
        space_prefix = kind == "llama" and bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        return cls(None, bos_id=bos, eos_id=eos, eos_ids=eog, add_bos=add_bos, add_eos=add_eos,
                   chat_template=_str_or_none(meta.get("tokenizer.chat_template")), vocab_size=len(tokens),
                   gguf=_GgufVocab(table, types, space_prefix, byte_level=kind == "gpt2", meta=meta))

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """From a Hugging Face model directory: tokenizer.json, tokenizer_config.json, and the EOS ids of
        generation_config.json / config.json."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise TokenizerError(f"no tokenizer.json in {path}")
        try:
            core = CoreTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise TokenizerError(f"cannot read {path / 'tokenizer.json'}: {e}") from None
        config = _read_json(path / "tokenizer_config.json")
        vocab = core.get_vocab(with_added_tokens=True)
        bos, eos = _hf_token_id(config.get("bos_token"), vocab), _hf_token_id(config.get("eos_token"), vocab)
        eos_ids = {eos} if eos is not None else set()
        for name in ("generation_config.json", "config.json"):
            value = _read_json(path / name).get("eos_token_id")
            eos_ids |= {int(i) for i in (value if isinstance(value, list) else [value]) if isinstance(i, int)}
        # encode adds BOS/EOS with the file's own post-processor, as transformers does; the flags say what it adds
        added = core.encode("", add_special_tokens=True).ids
        add_bos = bos is not None and added[:1] == [bos]
        add_eos = eos is not None and len(added) > add_bos and added[-1] == eos
        return cls(core, bos_id=bos, eos_id=eos, eos_ids=eos_ids, add_bos=add_bos, add_eos=add_eos,
                   chat_template=_hf_chat_template(path, config),
                   vocab_size=core.get_vocab_size(with_added_tokens=True))

    @property
    def core(self) -> CoreTokenizer:
        """The `tokenizers` model: HF, tokenizer.json's; GGUF, the BPE alone (special tokens are cut out
        first), built on first use."""
        return self._hf_core if self._gguf is None else self._gguf.bpe()

    # --- text -> ids ----------------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. add_special: BOS/EOS as the model's config says. parse_special: special
        tokens written in the text become their ids (llama.cpp's special=True, transformers' default);
        when False only user-defined tokens do, the rest is plain text."""
        if self._gguf is None:
            core = self.core if parse_special else self._literal()
            return core.encode(text, add_special_tokens=add_special).ids
        ids: list[int] = []
        if add_special and self.add_bos:
            ids.append(self.bos_id)  # type: ignore[arg-type]  # checked in from_gguf
        after_special = True  # SentencePiece: a space goes before text at the start and after a special
        for piece in self._gguf.split_specials(text, parse_special):
            if isinstance(piece, int):
                ids.append(piece)
                after_special = True
                continue
            if self._gguf.space_prefix and after_special:
                piece = " " + piece
            ids.extend(self._gguf.encode_text(piece))
            after_special = False
        if add_special and self.add_eos:
            ids.append(self.eos_id)  # type: ignore[arg-type]
        return ids

    def _literal(self) -> CoreTokenizer:
        # a second core, so that encode never flips a flag on a tokenizer another thread may be using
        if self._literal_core is None:
            literal = CoreTokenizer.from_str(self.core.to_str())
            literal.encode_special_tokens = True
            self._literal_core = literal
        return self._literal_core

    # --- ids -> text ----------------------------------------------------------------------------------
    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """The text of `ids`. Special tokens appear as written unless skip_special (user-defined tokens,
        being text, always appear in GGUF vocabularies, as in llama.cpp)."""
        if self._gguf is None:
            return self.core.decode(list(ids), skip_special_tokens=skip_special)
        text = b"".join(self._gguf.piece(i, skip_special) for i in ids).decode("utf-8", errors="replace")
        # SentencePiece: the space put before the text is not part of it (HF's Strip decoder)
        return text[1:] if self._gguf.space_prefix and text.startswith(" ") else text

    def token_text(self, token: int) -> str:
        """The vocabulary entry of `token` as the file writes it (e.g. "<|im_end|>", "Ġthe")."""
        if not 0 <= token < self.vocab_size:
            raise TokenizerError(f"token id {token} is outside the vocabulary ({self.vocab_size} tokens)")
        return self.core.id_to_token(token) if self._gguf is None else self._gguf.tokens[token]

    def pieces(self) -> list[tuple[bytes, bool]] | None:
        """GGUF: each token's bytes as decode writes them, and whether it is a control token (or the
        unknown one); None for a Hugging Face tokenizer, whose tokenizer.json (`core`) says it all."""
        if self._gguf is None:
            return None
        return [(self._gguf.piece(i, False), self._gguf.types[i] in (CONTROL, UNKNOWN)) for i in range(self.vocab_size)]

    def stream_decoder(self, skip_special: bool = False, context: Sequence[int] = ()) -> StreamDecoder:
        return StreamDecoder(self, skip_special, context)

    # --- bounds -------------------------------------------------------------------------------------
    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The most bytes of text one token of an encode can stand for, or None when the tokenizer
        can drop or fuse text (then no length of text bounds its tokens from below).

        A text of n bytes has at least n / max_token_bytes tokens: the daemon refuses a prompt too long
        for the context by its size, before encoding it. GGUF: the longest token's bytes, unless
        SentencePiece's unknown token can stand for a run of characters (no byte tokens to fall back
        on). Hugging Face: the longest vocabulary entry as written (never fewer bytes than the text it
        stands for), times what normalization can shrink a text by (NFKC: 4x, mathematical letters
        to ASCII; NFC and lowercasing: 3x, Hangul jamo into syllables, the Kelvin sign to "k"), and None
        for normalizers, pre-tokenizers and added tokens that may delete text (whitespace removal or
        stripping, cleanups) or models whose unknown token swallows a word."""
        if self._gguf is not None:
            return self._gguf.max_piece_bytes()
        model = self.core.model
        if type(model).__name__ != "BPE" or (model.unk_token is not None and model.fuse_unk
                                             and not (model.byte_fallback and _has_byte_tokens(self.core))):
            return None
        if any(t.lstrip or t.rstrip for t in self.core.get_added_tokens_decoder().values()):
            return None  # such a token swallows the whitespace beside it, however long
        slack = _text_shrink(self.core)
        if slack is None:
            return None
        longest = max(len(self.core.id_to_token(i).encode()) for i in range(self.vocab_size))
        return max(longest, 4) * slack  # 4: an unknown character (one token) is at most 4 bytes


class StreamDecoder:
    """Token ids in, text deltas out, never splitting a UTF-8 character (bytes of an unfinished one are
    held back). The deltas plus flush() add up to decode(all ids fed). Pass `context` (e.g. the prompt's
    ids) when the tokens continue a text: the deltas are then what the tokens add to it, as in
    decode(context + ids)[len(decode(context)):] (with SentencePiece the first token keeps its space).
    Each step decodes a short window, not the whole text (the text-generation-inference method)."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False, context: Sequence[int] = ()) -> None:
        self.tokenizer, self.skip_special = tokenizer, skip_special
        self._ids: list[int] = list(context[-5:])  # a few tokens of context are enough for any merge
        self._prefix = 0  # window start: text before it is final
        self._read = len(self._ids)  # ids whose text has been given out

    def feed(self, token: int) -> str:
        self._ids.append(token)
        before, now = self._window()
        if now.endswith("\ufffd") or len(now) <= len(before):
            return ""  # an unfinished UTF-8 character (or no text yet): wait for the tokens that finish it
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before) :]

    def flush(self) -> str:
        """The rest, at the end of the stream (a dangling partial character comes out as U+FFFD, as in
        decode)."""
        before, now = self._window()
        self._read = len(self._ids)
        return now[len(before) :]

    def _window(self) -> tuple[str, str]:
        # the text of the window's tokens before and after the new ones; the window starts at a token
        # whose text is final, so `before` is a prefix of `now` and the difference is the new text
        window = self._ids[self._prefix :]
        decode = self.tokenizer.decode
        return decode(window[: self._read - self._prefix], self.skip_special), decode(window, self.skip_special)


# --- GGUF vocabularies ---------------------------------------------------------------------------------
class _GgufVocab:
    """A GGUF vocabulary: the special tokens, each token's bytes, and the BPE, built from the metadata on
    the first encode (the demo's 8192-token BPE holds ~2.7 MB that decoding and models fed token ids
    never need), with (SentencePiece) the byte tokens of the characters that are no token, for when the BPE
    leaves them unmerged."""

    def __init__(self, tokens: StringTable, types: list[int], space_prefix: bool, byte_level: bool,
                 meta: Mapping[str, Any]) -> None:
        self.tokens = tokens
        self.types = bytes(ty if 0 <= ty < 256 else 0 for ty in types)  # a type no token has: as llama.cpp's undefined
        self.space_prefix, self.byte_level = space_prefix, byte_level
        # gemma4: the runs of newlines that are tokens (llama.cpp takes such a run whole, its PR 21343)
        self.newline_runs = ({t: i for i, t in enumerate(tokens) if t and not t.strip("\n")}
                             if meta.get("tokenizer.ggml.model") == "gemma4" else {})
        self._meta, self._lock = {k: meta[k] for k in _BPE_KEYS if k in meta}, threading.Lock()
        self._bpe: CoreTokenizer | None = None
        self.unmerged: Mapping[int, list[int]] = {}  # SentencePiece: the BPE's ids past the vocabulary -> byte tokens
        special = [i for i, ty in enumerate(types) if ty in (CONTROL, USER_DEFINED, UNKNOWN)]
        special.sort(key=lambda i: len(tokens[i].encode()), reverse=True)  # llama.cpp: longest first, in bytes
        self.specials = [(tokens[i], i, types[i] == USER_DEFINED) for i in special]
        self._pieces: dict[int, bytes] = {}

    def bpe(self) -> CoreTokenizer:
        """The BPE of the file's tokens and merges (gpt2) or scores (llama), built once, on first use."""
        with self._lock:  # encodes may start in several threads at once
            if self._bpe is None:
                self._bpe, self.unmerged = _gguf_bpe(self._meta)
                self._meta = {}
                # the build's garbage (Python cycles, malloc's free pages) held another 2.5-3 MB
                gc.collect()
                release_free_heap()
            return self._bpe

    def split_specials(self, text: str, parse_special: bool) -> list[str | int]:
        """`text` as plain-text fragments and special token ids, cut as llama.cpp's
        tokenizer_st_partition does: each special token, longest first, out of every fragment left."""
        parts: list[str | int] = [text] if text else []
        for token, token_id, user_defined in self.specials:
            if not (parse_special or user_defined) or token not in text:
                continue
            cut: list[str | int] = []
            for part in parts:
                if isinstance(part, int) or token not in part:
                    cut.append(part)
                    continue
                for j, fragment in enumerate(part.split(token)):
                    if j:
                        cut.append(token_id)
                    if fragment:
                        cut.append(fragment)
            parts = cut
        return parts

    def max_piece_bytes(self) -> int | None:
        """Tokenizer.max_token_bytes of this vocabulary: None when a character could be dropped or
        fused into an unknown token, which only a vocabulary without every byte's token allows."""
        known = set(self.tokens)
        if self.byte_level:  # a byte whose character is no token would be dropped by the BPE
            complete = all(c in known for c in _BYTE_OF_CHAR)
        else:  # SentencePiece falls back on <0xXX> tokens, else on the (fused) unknown token
            complete = all(t in known for t in _BYTE_TOKENS)
        if not complete:
            return None
        return max(len(self.piece(i, False)) for i in range(len(self.tokens)))

    def encode_text(self, text: str) -> list[int]:
        """The ids of a fragment with no special token in it."""
        if not self.newline_runs:
            return self.resolve(self.bpe().encode(text, add_special_tokens=False).ids)
        ids: list[int] = []
        for part in _NEWLINE_RUNS.split(text):  # gemma4: a run of newlines that is a token is that token
            whole = self.newline_runs.get(part)
            if whole is not None:
                ids.append(whole)
            elif part:
                ids.extend(self.bpe().encode(part, add_special_tokens=False).ids)
        return ids

    def resolve(self, ids: list[int]) -> list[int]:
        """The BPE's ids with the characters it left unmerged that are no token as their byte tokens."""
        if not self.unmerged:
            return ids
        return [j for i in ids for j in self.unmerged.get(i, (i,))]

    def piece(self, token: int, skip_special: bool) -> bytes:
        """The bytes of one token, as llama.cpp's token_to_piece."""
        if not 0 <= token < len(self.tokens):
            raise TokenizerError(f"token id {token} is outside the vocabulary ({len(self.tokens)} tokens)")
        kind = self.types[token]
        if kind in (CONTROL, UNKNOWN):
            return b"" if skip_special else self.tokens[token].encode()
        if token not in self._pieces:
            self._pieces[token] = self._bytes(token, kind)
        return self._pieces[token]

    def _bytes(self, token: int, kind: int) -> bytes:
        text = self.tokens[token]
        if kind == USER_DEFINED:
            return text.encode()
        if kind == BYTE:  # <0xXX>
            return bytes([int(text[3:5], 16)])
        if kind != NORMAL:
            return b""  # unused and undefined tokens: llama.cpp writes nothing
        if self.byte_level:  # gpt2: each character stands for one byte (a char outside the map: itself)
            return b"".join(bytes([_BYTE_OF_CHAR[c]]) if c in _BYTE_OF_CHAR else c.encode() for c in text)
        return text.replace("\u2581", " ").encode()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character table (the one ByteLevel uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}


def _gguf_bpe(meta: Mapping[str, Any]) -> tuple[CoreTokenizer, dict[int, list[int]]]:
    """A GGUF vocabulary's BPE and (SentencePiece) the byte tokens of its ids past the vocabulary."""
    kind, tokens, _, types = _read_vocabulary(meta)  # the types before _drop_message_ends: only UNKNOWN counts
    if kind == "gpt2":
        return _gpt2_core(tokens, _read_merges(meta), _pre_tokenizer(meta.get("tokenizer.ggml.pre"))), {}
    if kind == "gemma4":
        return _gemma4_core(tokens, _read_merges(meta)), {}
    return _spm_core(tokens, _read_numbers(meta, "tokenizer.ggml.scores", len(tokens), 0.0, float), types)


def _gpt2_core(tokens: list[str], merges: list[tuple[str, str]], pre: PreTokenizer) -> CoreTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    # a merge that names a piece missing from the vocabulary can never produce a token: leave it out
    merges = [(a, b) for a, b in merges if a in vocab and b in vocab and a + b in vocab]
    if not pre.ignore_merges:  # with it, a word that is a token is that token, whatever merges make
        vocab = _producible(vocab, merges)
    core = CoreTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False,
                                    ignore_merges=pre.ignore_merges))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    core.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                     use_regex=False)])
    return core  # no decoder: decode joins the tokens' bytes (_GgufVocab.piece), as llama.cpp does


def _gemma4_core(tokens: list[str], merges: list[tuple[str, str]]) -> CoreTokenizer:
    """llama.cpp's gemma4 BPE: merges over characters with "▁" for spaces, each line cut apart (the
    runs of newlines between are _GgufVocab.encode_text's), <0xXX> tokens for characters no merge
    reaches."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [(a, b) for a, b in merges if a in vocab and b in vocab and a + b in vocab]
    core = CoreTokenizer(models.BPE(_producible(vocab, merges, also=_BYTE_TOKENS), merges, fuse_unk=False,
                                    byte_fallback=True))
    core.normalizer = normalizers.Replace(" ", "\u2581")
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    return core


def _spm_core(tokens: list[str], scores: list[float],
              types: list[int]) -> tuple[CoreTokenizer, dict[int, list[int]]]:
    """llama.cpp's SentencePiece tokenizer as a BPE, and the byte tokens of the BPE's ids past the
    vocabulary (for _GgufVocab.resolve).

    llama.cpp starts from the text's characters and merges the adjacent pair whose concatenation is the
    best-scoring token first, which is what merges ranked by that score do. A character need not be a
    token to merge ("▁" + "a" -> "▁a" without "▁" or "a" in the vocabulary); only those left unmerged at
    the end become byte tokens. A BPE merges only pieces of its vocabulary, so such characters join it
    here past the file's ids, and the ones left in its output are turned into bytes afterwards. Ties go by
    position in llama.cpp and by rank here; real vocabularies rarely tie (transformers builds the same
    merges)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    loose = sorted({c for t in tokens for c in t} - vocab.keys())  # characters that are no token
    symbols = vocab | {c: len(tokens) + k for k, c in enumerate(loose)}
    merges = []
    for piece, token_id in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in symbols and right in symbols:
                merges.append((-scores[token_id], -len(left), -len(right), left, right))
    merges.sort(key=lambda m: m[:3])  # stable: the file's order among equals
    pairs = [(m[3], m[4]) for m in merges]
    unk = next((t for t, ty in zip(tokens, types) if ty == UNKNOWN), None)
    bpe_symbols = _producible(symbols, pairs, also=[*_BYTE_TOKENS, *([unk] if unk is not None else [])])
    core = CoreTokenizer(models.BPE(bpe_symbols, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    core.normalizer = normalizers.Replace(" ", "\u2581")
    return core, {symbols[c]: _byte_fallback(c, vocab, unk) for c in loose}


# the metadata a GGUF vocabulary's BPE is built from (_GgufVocab keeps them until it has built it)
_BPE_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
             "tokenizer.ggml.pre", "tokenizer.ggml.scores")
_BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]  # SentencePiece's byte_fallback pieces
_NEWLINE_RUNS = re.compile("(\n+)")


def _producible(vocab: Mapping[str, int], merges: Sequence[tuple[str, str]],
                also: Iterable[str] = ()) -> dict[str, int]:
    """The entries of `vocab` a BPE without whole-word lookups can output: single characters, what the
    merges make and take, and `also`. The rest never leave it, so it need not hold them: a vocabulary
    padded to a round size (llama.cpp's converter writes `[PAD<id>]` tokens) would otherwise cost
    `tokenizers` ~240 bytes a token (the 100M benchmark file: 32000 tokens, 8191 producible, 7.7 -> 2.9 MB)."""
    keep = {t for t in vocab if len(t) == 1}
    keep.update(x for a, b in merges for x in (a, b, a + b))
    keep.update(t for t in also if t in vocab)
    return {t: i for t, i in vocab.items() if t in keep}


def _byte_fallback(char: str, vocab: Mapping[str, int], unk: str | None) -> list[int]:
    """What the BPE's byte_fallback gives a character that is no token: its bytes' <0xXX> tokens if the
    vocabulary has them all (as llama.cpp), else the unknown token."""
    byte_tokens = [_BYTE_TOKENS[b] for b in char.encode()]
    if all(t in vocab for t in byte_tokens):
        return [vocab[t] for t in byte_tokens]
    return [vocab[unk]] if unk is not None else []


# --- reading GGUF metadata --------------------------------------------------------------------------------
def _read_vocabulary(meta: Mapping[str, Any]) -> tuple[str, list[str], StringTable, list[int]]:
    """(tokenizer.ggml.model, tokens, the same packed (what the tokenizer keeps), token types as llama.cpp
    sees them), checked."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None or meta.get("tokenizer.ggml.tokens") is None:
        raise TokenizerError("no tokenizer in the file (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
    if kind not in ("gpt2", "llama", "gemma4"):
        raise TokenizerError(f"unsupported tokenizer model {kind!r} (tokenizer.ggml.model; supported: gpt2, llama, "
                             "gemma4)")
    table = meta["tokenizer.ggml.tokens"]
    tokens = list(table) if isinstance(table, list | StringTable) else []
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise TokenizerError("tokenizer.ggml.tokens is not a list of strings")
    if not all(tokens) or not isinstance(table, StringTable):
        tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # as llama.cpp names empty entries
        table = StringTable.of(tokens)
    if len(set(tokens)) != len(tokens):
        seen: set[str] = set()
        duplicate = next(t for t in tokens if t in seen or seen.add(t))  # type: ignore[func-returns-value]
        raise TokenizerError(f"duplicate token in tokenizer.ggml.tokens: {duplicate!r}")
    types = _read_numbers(meta, "tokenizer.ggml.token_type", len(tokens), NORMAL, int)
    return kind, tokens, table, _types_as_llama_cpp_sees_them(tokens, types)


def _read_numbers(meta: Mapping[str, Any], key: str, n: int, default: Any, kind: type) -> list[Any]:
    values = meta.get(key)
    if values is None:
        return [default] * n
    if not isinstance(values, list) or len(values) < n or not all(isinstance(v, int | float) for v in values[:n]):
        raise TokenizerError(f"{key} is not a list of {n} numbers")
    return [kind(v) for v in values[:n]]


def _merge_list(meta: Mapping[str, Any]) -> Sequence[str]:
    """tokenizer.ggml.merges, checked."""
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise TokenizerError("tokenizer.ggml.merges is missing (a gpt2 tokenizer needs its merges)")
    listed = isinstance(merges, list) and all(isinstance(m, str) for m in merges)
    if not (isinstance(merges, StringTable) or listed):
        raise TokenizerError("tokenizer.ggml.merges is not a list of strings")
    return merges


def _read_merges(meta: Mapping[str, Any]) -> list[tuple[str, str]]:
    pairs = []
    for merge in _merge_list(meta):
        cut = merge.find(" ", 1)  # as llama.cpp: the first space after the first character
        if cut > 0:
            pairs.append((merge[:cut], merge[cut + 1 :]))
    return pairs


def _pre_tokenizer(name: Any) -> PreTokenizer:
    if name is None:
        return PRE_TOKENIZERS["default"]  # llama.cpp warns and uses its default regexes
    if name not in PRE_TOKENIZERS:
        raise TokenizerError(f"unsupported pre-tokenizer {name!r} (tokenizer.ggml.pre; supported: "
                             f"{', '.join(sorted(PRE_TOKENIZERS))})")
    return PRE_TOKENIZERS[name]


def _types_as_llama_cpp_sees_them(tokens: Sequence[str], types: list[int]) -> list[int]:
    """llama.cpp makes tokens named like end-of-turn / fill-in-the-middle tokens control tokens, whatever
    the file says, and the gpt-oss channel tokens user-defined."""
    fim = {name for group in _FIM_EOG_NAMES for name in group}
    forced = {"<fim-prefix>", "<|fim_prefix|>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
              "<|code_prefix|>", "<|prefix|>", "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>",
              "<SUF>", "▁<SUF>", "<|code_suffix|>", "<|suffix|>", "<|fim_middle|>", "<fim-middle>", "<fim_middle>",
              "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>", "<|middle|>"} | fim | _EOG_NAMES
    types = [CONTROL if t in forced and ty != CONTROL else ty for t, ty in zip(tokens, types)]
    return [USER_DEFINED if t in _ALWAYS_USER_DEFINED else ty for t, ty in zip(tokens, types)]


def _end_of_generation_ids(meta: Mapping[str, Any], tokens: list[str], eos: int | None) -> set[int]:
    """llama.cpp's special_eog_ids: EOS, EOT, EOM, tokens with end-of-turn names, FIM pad/repo/sep."""
    index = {t: i for i, t in enumerate(tokens)}
    ids = {index[name] for name in _EOG_NAMES if name in index}
    for key, names in zip(("fim_pad", "fim_rep", "fim_sep"), _FIM_EOG_NAMES):
        ids.add(_token_id(meta, key, len(tokens), next((index[n] for n in names if n in index), None)))
    for key, default in (("eot", None), ("eom", None), ("eos", eos)):
        ids.add(_token_id(meta, key, len(tokens), default))
    ids.discard(None)  # type: ignore[arg-type]
    return ids


def _drop_message_ends(tokens: list[str], types: list[int], eog: set[int]) -> None:
    """llama.cpp's workarounds: with <|return|>/<|call|> (gpt-oss) or <|calls|>/<|flush|> (solar-open),
    <|end|> ends a message, not the turn; with <|tool_response> (gemma 4), </s> is plain text."""
    names = {tokens[i]: i for i in eog}
    ends_turn = ({"<|return|>", "<|call|>"}, {"<|calls|>", "<|flush|>"})
    if "<|end|>" in names and any(pair <= names.keys() for pair in ends_turn):
        eog.discard(names["<|end|>"])
        types[names["<|end|>"]] = USER_DEFINED
    if "<|tool_response>" in names and "</s>" in names:
        eog.discard(names["</s>"])
        types[names["</s>"]] = NORMAL


def _add_flags(meta: Mapping[str, Any], add_bos: bool, bos: int | None, eos: int | None) -> tuple[bool, bool]:
    """(add BOS, add EOS): the file's flags, else llama.cpp's defaults; a flag needs its token."""
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    for name, wanted, token in (("bos", add_bos, bos), ("eos", add_eos, eos)):
        if wanted and token is None:
            raise TokenizerError(f"tokenizer.ggml.add_{name}_token is set but tokenizer.ggml.{name}_token_id "
                                 "is missing")
    return add_bos, add_eos


def _token_id(meta: Mapping[str, Any], name: str, n_tokens: int, default: int | None) -> int | None:
    """tokenizer.ggml.<name>_token_id; like llama.cpp, an id outside the vocabulary is ignored."""
    value = meta.get(f"tokenizer.ggml.{name}_token_id")
    if isinstance(value, int) and 0 <= value < n_tokens:
        return value
    return default if default is not None and default < n_tokens else None


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _has_byte_tokens(core: CoreTokenizer) -> bool:
    vocab = core.get_vocab(with_added_tokens=False)
    return all(t in vocab for t in _BYTE_TOKENS)


# how many times fewer bytes a normalizer can leave of a text (NFKC: "𝐀" 4 bytes -> "A"; NFC: 3 jamo -> 1 syllable)
_SHRINKS = {"NFC": 3, "NFD": 3, "NFKC": 4, "NFKD": 4, "Lowercase": 3, "Prepend": 1}
_KEEPS_TEXT = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}  # pre-tokenizers that drop nothing


def _text_shrink(core: CoreTokenizer) -> int | None:
    """How many times shorter in bytes the text the model sees can be than the text given (None:
    without bound, as for a normalizer or pre-tokenizer that deletes text)."""
    factor = 1
    for part in _parts(core.normalizer, "normalizers"):
        kind = part.get("type")
        if kind == "Replace" and "String" in part.get("pattern", {}):  # shrinks by at most pattern / content
            pattern, content = part["pattern"]["String"].encode(), str(part.get("content", "")).encode()
            if not content:
                return None
            factor *= max(1, -(-len(pattern) // len(content)))
        elif kind in _SHRINKS:
            factor *= _SHRINKS[kind]
        else:
            return None
    for part in _parts(core.pre_tokenizer, "pretokenizers"):
        kind = part.get("type")
        if not (kind in _KEEPS_TEXT or (kind in ("Split", "Punctuation") and part.get("behavior") != "Removed")):
            return None
    return factor


def _parts(component: Any, key: str) -> list[dict[str, Any]]:
    """A normalizer's or pre-tokenizer's steps, as tokenizer.json writes them (a Sequence flattened)."""
    if component is None:
        return []
    state = json.loads(component.__getstate__())
    steps, out = [state], []
    while steps:
        step = steps.pop(0)
        if step.get("type") == "Sequence":
            steps[:0] = step.get(key, [])
        else:
            out.append(step)
    return out


# --- reading Hugging Face directories -------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"invalid JSON in {path}: {e}") from None
    return data if isinstance(data, dict) else {}


def _hf_token_id(token: Any, vocab: Mapping[str, int]) -> int | None:
    if isinstance(token, dict):  # {"content": "<s>", ...} in older tokenizer_config files
        token = token.get("content")
    return vocab.get(token) if isinstance(token, str) else None


def _hf_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja, chat_template.json, or tokenizer_config.json's
    (a string, or a list of named templates)."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = _read_json(path / "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return _str_or_none(template)
