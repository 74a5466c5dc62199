"""Test data for the tokenizer tests: a corpus of awkward strings, and small vocabulary-only GGUF files
(byte-level BPE and SentencePiece) that llama.cpp opens with vocab_only=True."""
from __future__ import annotations

import json
import random
from functools import cache
from pathlib import Path
from typing import Any

import gguf
import tokenizers

# token types as GGUF writes them
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

FIXED = [
    "", " ", "  ", "\n", "\t", "hello world", "Hello World", "  multiple   spaces  ", "\t\ttabs\tand\nnewlines\n\n\n",
    "def f(x):\n    return x**2  # squared\n", "if (a && b) { return -1; }\r\n", "don't I'll we've they're IT'S",
    "I'M YOU'RE WE'LL he'd she'S", "12345678 3.14159 1e-9 007 1,000,000", "0123456789012345678901234567890123456789",
    "Ünïcödé café naïve Ærøskøbing", "日本語のテキストです。", "中文 文本，标点！", "한국어 텍스트", "ภาษาไทย",
    "emoji 🎉🎉 👩‍👩‍👧 🇫🇷 👍🏽", "a\u0301 e\u0300 combining n\u0303\u0308", "مرحبا بالعالم ١٢٣", "שלום עולם",
    "हिन्दी पाठ", "Ελληνικά κείμενο", "Привет, мир!", "ǅemal Ⅻ ﬁnance ß ẞ", "   leading", "trailing   ",
    "x\r\ny\rz", "!!!???...,,,", "$$ € ¥ £ ~`^|<>=+", "\u00a0nbsp\u2003em space\u3000ideographic",
    "ALLCAPS lower MiXeD",
    "https://example.com/path?q=1&r=2#frag", '{"json": [1, 2, {"k": null}]}', "a" * 300, " " * 40 + "x",
    "\n" * 7, "tab\t\t\t\tend", "<|endoftext|>", "text<|endoftext|>more text", "<|endoftext|><|endoftext|>",
    "<|endoftext", "endoftext|>", "< |endoftext| >", "\x01\x02\x7f control chars", "\ufffd replacement", "😀" * 20,
]


def corpus(n: int = 300, seed: int = 0, specials: tuple[str, ...] = ("<|endoftext|>",)) -> list[str]:
    """FIXED plus random strings over an alphabet that stresses pre-tokenizers and special tokens."""
    rng = random.Random(seed)
    alphabet = [*"ab cd\n\t\r😀é日'sLL12.<|>_-ÀÉ", "'re", "'S", "  ", "\n\n", "ﬁ", "ß", "x1", "…", "。", "，", "٣", "(",
                ")", "$", "`", "~", "한", "ا", "\u0301", "\u00a0", "ǅ", "Ⅻ", "42", "    ", *specials]
    random_texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 50))) for _ in range(n - len(FIXED))]
    return FIXED + random_texts


TRAIN_TEXT = [line for _ in range(3) for line in FIXED] + [
    "The quick brown fox jumps over the lazy dog 1234567890 times. It's 3:45pm, isn't it?",
    "for i in range(100):\n    total += values[i] * weights[i]\n", "Ça va? Très bien, merci! 日本語 中文 🎉",
    "    if x:\n        return y\n    else:\n        return z\n", "1 12 123 1234 12345 123456",
]


# --- vocabulary-only GGUF files ---------------------------------------------------------------------------
def write_vocab_gguf(path: Path, model: str, tokens: list[str], types: list[int], **keys: Any) -> Path:
    """A GGUF file with a tokenizer and no tensors, which llama.cpp opens with vocab_only=True: it only
    needs general.architecture and the llama.* hyperparameters it reads before the vocabulary.
    keys (None: left out): pre, merges, scores, bos, eos, add_bos, add_space_prefix, chat_template."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in dict(block_count=1, context_length=512, embedding_length=64, feed_forward_length=128).items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_uint32("llama.attention.head_count", 4)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    adders = dict(pre=writer.add_tokenizer_pre, merges=writer.add_token_merges, scores=writer.add_token_scores,
                  bos=writer.add_bos_token_id, eos=writer.add_eos_token_id, add_bos=writer.add_add_bos_token,
                  add_space_prefix=writer.add_add_space_prefix, chat_template=writer.add_chat_template)
    for key, value in keys.items():
        if value is not None:
            adders[key](value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_metadata(path: Path) -> dict[str, Any]:
    """The metadata dict Tokenizer.from_gguf takes, read with gguf-py."""
    return {f.name: f.contents() for f in gguf.GGUFReader(path).fields.values()}


# Special tokens of the test vocabularies: control ones, an end-of-turn name the file types NORMAL
# (llama.cpp makes it a control token), a user-defined one (always parsed), and one that overlaps the
# others in text, to check that they are cut longest first as llama.cpp does.
BPE_SPECIALS = ["<|begin|>", "<|end|>", "<|im_end|>", "<think>", "|>xyzw<|"]
BPE_SPECIAL_TYPES = {"<|begin|>": CONTROL, "<|end|>": CONTROL, "<|im_end|>": NORMAL, "<think>": USER_DEFINED,
                     "|>xyzw<|": USER_DEFINED}


@cache
def whole_text_bpe_vocab(texts: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(tokens, merges) of a byte-level BPE trained here on whole texts, with no pre-tokenizer, until each
    text is one token: a pre-tokenizer that cuts a text shows in its ids."""
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=100_000, min_frequency=1, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    model = json.loads(bpe.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    return tokens, [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]


@cache
def byte_bpe_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, types, merges) of a byte-level BPE trained here with `tokenizers`."""
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(TRAIN_TEXT, vocab_size=600, min_frequency=1, special_tokens=BPE_SPECIALS)
    tokens = [t for t, _ in sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])]
    types = [BPE_SPECIAL_TYPES.get(t, NORMAL) for t in tokens]
    merges = json.loads(bpe._tokenizer.to_str())["model"]["merges"]
    return tokens, types, [m if isinstance(m, str) else " ".join(m) for m in merges]


SPM_SPECIALS = {"<unk>": UNKNOWN, "<s>": CONTROL, "</s>": CONTROL, "<start_of_turn>": USER_DEFINED}


@cache
def spm_vocab(drop_chars: str = "") -> tuple[list[str], list[int], list[float]]:
    """(tokens, types, scores) of a llama-style SentencePiece vocabulary: <unk>, <s>, </s>, a user-defined
    token, 256 byte tokens, then the pieces of a SentencePiece BPE trained here, scored by merge order
    (earlier merge, higher score) as SentencePiece BPE models are. drop_chars: single characters left
    out of the pieces ("*": all of them) while the pieces merged from them stay (e.g. "▁t" without "▁")."""
    sp = tokenizers.SentencePieceBPETokenizer(add_prefix_space=True)
    sp.train_from_iterator(TRAIN_TEXT, vocab_size=500, min_frequency=1, special_tokens=[])
    model = json.loads(sp._tokenizer.to_str())["model"]
    merged = ["".join(m if isinstance(m, list) else m.split(" ")) for m in model["merges"]]
    chars = [t for t in sorted(model["vocab"]) if len(t) == 1 and drop_chars != "*" and t not in drop_chars]
    pieces = list(dict.fromkeys(chars + merged))
    tokens = [*SPM_SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [*SPM_SPECIALS.values(), *[BYTE] * 256, *[NORMAL] * len(pieces)]
    scores = [0.0] * (len(SPM_SPECIALS) + 256) + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores
