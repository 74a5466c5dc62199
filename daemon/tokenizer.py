"""Tokenizer: text <-> token ids exactly as the model file defines them.

GGUF vocabularies (`tokenizer.ggml.*`) are rebuilt as a `tokenizers` BPE model: gpt2-style byte-level
BPE with the pre-tokenizer regex llama.cpp uses for the file's `tokenizer.ggml.pre`, or llama-style
SentencePiece BPE (merges ranked by the merged piece's score, byte fallback, "▁" for spaces).
Special tokens in the text are split off first, fragment by fragment, as llama.cpp does, so ids equal
llama.cpp's. Hugging Face directories use their tokenizer.json as it is, so ids equal transformers'.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as CoreTokenizer


class TokenizerError(ValueError):
    """The file's tokenizer is missing or cannot be built."""


# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp), by tokenizer.ggml.pre
_GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3 = (r"""(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
           r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
_QWEN2 = (r"""(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
          r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
PRE_TOKENIZERS = {"default": _GPT2, "gpt-2": _GPT2, "gpt2": _GPT2, "llama-bpe": _LLAMA3, "llama3": _LLAMA3,
                  "qwen2": _QWEN2}

# GGUF token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# end-of-generation tokens llama.cpp recognises by name when the file marks them as control tokens
_EOG_NAMES = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "<|eom_id|>")


@dataclass
class Tokenizer:
    core: CoreTokenizer  # the BPE itself; for GGUF files it knows no special tokens (split off first)
    specials: dict[str, int]  # special token text -> id, split off the text before the core runs
    always_split: frozenset[str]  # user-defined tokens, parsed even when parse_special is False
    bos_id: int | None
    add_bos: bool
    eos_id: int | None
    add_eos: bool
    eos_ids: frozenset[int]
    vocab_size: int
    chat_template: str | None = None
    space_prefix: bool = False  # SPM: "▁" before each text fragment that follows a special token or the start
    _special_ids: frozenset[int] = field(default=frozenset(), repr=False)
    _pattern: re.Pattern[str] | None = field(default=None, repr=False)
    _hf: bool = False  # a tokenizer.json used as it is (HF semantics for special tokens and BOS)

    def __post_init__(self) -> None:
        self._special_ids = frozenset(self.specials.values())
        if self.specials:
            alternatives = sorted(self.specials, key=len, reverse=True)  # longest match first
            self._pattern = re.compile("|".join(re.escape(s) for s in alternatives))

    # --- construction -----------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any]) -> Tokenizer:
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if kind is None or not tokens:
            raise TokenizerError("no tokenizer in the file (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
        types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise TokenizerError("tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length")
        if kind == "gpt2":
            core = _gpt2_core(tokens, meta.get("tokenizer.ggml.merges") or [], meta.get("tokenizer.ggml.pre"))
            space_prefix, default_bos = False, False
        elif kind == "llama":
            core = _spm_core(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens), types)
            space_prefix, default_bos = bool(meta.get("tokenizer.ggml.add_space_prefix", True)), True
        else:
            raise TokenizerError(f"unsupported tokenizer model {kind!r} (supported: gpt2, llama)")
        specials = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (CONTROL, USER_DEFINED, UNKNOWN)}
        bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
        eog = {i for i in (eos, meta.get("tokenizer.ggml.eot_token_id"), meta.get("tokenizer.ggml.eom_token_id"))
               if i is not None}
        eog |= {specials[name] for name in _EOG_NAMES if name in specials and types[specials[name]] == CONTROL}
        return cls(
            core=core, specials=specials,
            always_split=frozenset(t for t, i in specials.items() if types[i] == USER_DEFINED),
            bos_id=None if bos is None else int(bos), add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)),
            eos_id=None if eos is None else int(eos), add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            eos_ids=frozenset(int(i) for i in eog), vocab_size=len(tokens),
            chat_template=meta.get("tokenizer.chat_template"), space_prefix=space_prefix,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not (path / "tokenizer.json").exists():
            raise TokenizerError(f"no tokenizer.json in {path}")
        try:
            core = CoreTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # tokenizers raises its own Exception subclass for malformed files
            raise TokenizerError(f"cannot read tokenizer.json: {e}") from None
        config = _read_json(path / "tokenizer_config.json")
        vocab = core.get_vocab(with_added_tokens=True)
        bos, eos = _token_id(config.get("bos_token"), vocab), _token_id(config.get("eos_token"), vocab)
        eos_ids = {eos} if eos is not None else set()
        for name in ("generation_config.json", "config.json"):
            value = _read_json(path / name).get("eos_token_id")
            eos_ids |= set(value if isinstance(value, list) else [] if value is None else [value])
        template = config.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        specials = {t.content: i for i, t in core.get_added_tokens_decoder().items() if t.special}
        return cls(core=core, specials=specials, always_split=frozenset(), bos_id=bos, add_bos=False, eos_id=eos,
                   add_eos=False, eos_ids=frozenset(int(i) for i in eos_ids), vocab_size=core.get_vocab_size(),
                   chat_template=template if isinstance(template, str) else None, _hf=True)

    # --- text <-> ids ---------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        if self._hf:  # the file's own post-processor adds BOS/EOS; its added tokens are split by the core
            self.core.encode_special_tokens = not parse_special
            return self.core.encode(text, add_special_tokens=add_special).ids
        return self._encode_fragments(text, add_special, parse_special)

    def _encode_fragments(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        ids: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            ids.append(self.bos_id)
        after_special = True  # llama.cpp: a space prefix goes before text at the start or after a special
        for piece, special_id in self._fragments(text, parse_special):
            if special_id is not None:
                ids.append(special_id)
                after_special = True
                continue
            if self.space_prefix and after_special:
                piece = " " + piece
            ids.extend(self.core.encode(piece, add_special_tokens=False).ids)
            after_special = False
        if add_special and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def _fragments(self, text: str, parse_special: bool) -> Iterable[tuple[str, int | None]]:
        pos = 0
        if self._pattern is not None:
            for m in self._pattern.finditer(text):
                if not parse_special and m.group() not in self.always_split:
                    continue
                if m.start() > pos:
                    yield text[pos : m.start()], None
                yield m.group(), self.specials[m.group()]
                pos = m.end()
        if pos < len(text):
            yield text[pos:], None

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids`; special tokens appear as their text unless skip_special."""
        parts, run = [], []
        for i in ids:
            if i in self._special_ids:
                parts.append(self._decode_run(run))
                run = []
                if not skip_special:
                    parts.append(self.core.id_to_token(i) or "")
            else:
                run.append(i)
        parts.append(self._decode_run(run))
        text = "".join(parts)
        # SPM: the space prefix added before the text is not part of it (HF's Strip decoder, llama.cpp)
        return text[1:] if self.space_prefix and text.startswith(" ") else text

    def _decode_run(self, ids: list[int]) -> str:
        return self.core.decode(ids, skip_special_tokens=False) if ids else ""

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special)


class StreamDecoder:
    """Token ids in, text deltas out, never splitting a UTF-8 character: the concatenation of the
    deltas equals decode(all ids). Decodes a short window, not the whole text, at each token."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self.tokenizer, self.skip_special = tokenizer, skip_special
        self.ids: list[int] = []
        self._prefix = 0  # window start: text before it is final
        self._read = 0  # ids whose text has been emitted

    def feed(self, token: int) -> str:
        self.ids.append(token)
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix : self._read], self.skip_special)
        now = decode(self.ids[self._prefix :], self.skip_special)
        if now.endswith("\ufffd") or len(now) <= len(before):
            return ""  # an incomplete UTF-8 sequence: wait for the bytes that finish it
        self._prefix, self._read = self._read, len(self.ids)
        return now[len(before) :]

    def flush(self) -> str:
        """What is left at the end (a dangling partial character decodes as U+FFFD, as decode does)."""
        decode = self.tokenizer.decode
        rest = decode(self.ids[self._prefix :], self.skip_special)[len(decode(self.ids[self._prefix : self._read], self.skip_special)) :]
        self._prefix = self._read = len(self.ids)
        return rest


def _gpt2_core(tokens: list[str], merges: list[str], pre: str | None) -> CoreTokenizer:
    if (pre or "default") not in PRE_TOKENIZERS:
        raise TokenizerError(f"unsupported pre-tokenizer {pre!r} (supported: {', '.join(PRE_TOKENIZERS)})")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    if any(len(p) != 2 for p in pairs):
        raise TokenizerError("malformed tokenizer.ggml.merges entry")
    core = CoreTokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False,
                                    ignore_merges=pre in ("llama-bpe", "llama3")))
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZERS[pre or "default"]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    core.decoder = decoders.ByteLevel()
    return core


def _spm_core(tokens: list[str], scores: list[float], types: list[int]) -> CoreTokenizer:
    """llama.cpp's SPM tokenizer as BPE: merging the pair whose result has the best score first is
    what merges ranked by that score do."""
    vocab = {t: i for i, t in enumerate(tokens)}
    mergeable = {t for t, ty in zip(tokens, types) if ty in (NORMAL, UNUSED)}
    merges = []
    for piece in mergeable:
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((scores[vocab[piece]], -vocab[piece], left, right))
    merges.sort(key=lambda m: (-m[0], -m[1]))
    unk = next((t for t, ty in zip(tokens, types) if ty == UNKNOWN), None)
    core = CoreTokenizer(models.BPE(vocab, [(a, b) for _, _, a, b in merges], unk_token=unk, fuse_unk=True,
                                    byte_fallback=True))
    core.normalizer = normalizers.Replace(" ", "\u2581")
    core.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return core


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TokenizerError(f"invalid JSON in {path.name}: {e}") from None
    return data if isinstance(data, dict) else {}


def _token_id(token: Any, vocab: Mapping[str, int]) -> int | None:
    if isinstance(token, dict):  # {"content": "<s>", ...} in older tokenizer_config files
        token = token.get("content")
    return vocab.get(token) if isinstance(token, str) else None
