"""Token ids equal llama.cpp's (same GGUF file) and Hugging Face's (same tokenizer.json), for the
tokenizer kinds real files use: gpt2-style byte-level BPE with the gpt-2, llama-bpe (Llama 3) and qwen2
pre-tokenizers, and llama-style SentencePiece BPE."""
from __future__ import annotations

import random
from pathlib import Path

import gguf
import pytest

from ember.daemon.demo_model import DEMO_MODEL
from ember.daemon.gguf_file import open_gguf
from ember.daemon.tokenizer import CONTROL, Tokenizer, TokenizerError
from tiny_models import DEMO_TOKENIZER

llama_cpp = pytest.importorskip("llama_cpp")
tokenizers = pytest.importorskip("tokenizers")

FIXED = [
    "", " ", "\n", "hello world", "Hello World", "  multiple   spaces", "\t\ttabs\tand\nnewlines\n\n\n",
    "def f(x):\n    return x**2  # squared\n", "don't I'll we've they're IT'S", "12345678 3.14159 1e-9 007",
    "Ünïcödé café naïve", "日本語のテキスト", "中文 文本", "한국어", "emoji 🎉🎉 👩‍👩‍👧 🇫🇷", "a\u0301 e\u0300 combining",
    "مرحبا بالعالم", "שלום עולם", "<|endoftext|>", "text<|endoftext|>more text", "<|endoftext|><|endoftext|>",
    "   leading", "trailing   ", "x\r\ny\rz", "!!!???...,,,", "$$ € ¥ £", "\u00a0nbsp\u2003em space", "ALLCAPS lower MiXeD",
    "https://example.com/path?q=1&r=2", "{\"json\": [1, 2, {\"k\": null}]}", "a" * 300,
]


def corpus(n: int = 300, seed: int = 0) -> list[str]:
    """FIXED plus random strings over an alphabet that stresses the pre-tokenizers."""
    rng = random.Random(seed)
    alphabet = list("ab cd\n\t\r😀é日'sLL12.<|>_-") + ["'re", "<|endoftext|>", "  ", "\n\n", "ﬁ", "ß"]
    return FIXED + ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(n - len(FIXED))]


def llama_ids(path: Path, text: str, add_bos: bool = True) -> list[int]:
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return llm.tokenize(text.encode(), add_bos=add_bos, special=True)


def assert_same_ids(ours: Tokenizer, path: Path, texts: list[str]) -> None:
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    mismatches = [t for t in texts if ours.encode(t) != llm.tokenize(t.encode(), add_bos=True, special=True)]
    assert not mismatches, f"{len(mismatches)} of {len(texts)} differ, e.g. {mismatches[:3]!r}"


# --- gpt2 BPE from GGUF (the demo model, converted by llama.cpp's own converter) -----------------------
@pytest.fixture(scope="module")
def demo() -> Tokenizer:
    return Tokenizer.from_gguf(open_gguf(DEMO_MODEL).metadata)


def test_demo_gguf_ids_equal_llama_cpp(demo: Tokenizer) -> None:
    assert_same_ids(demo, DEMO_MODEL, corpus())


def test_demo_gguf_ids_equal_hf_tokenizer_json(demo: Tokenizer) -> None:
    hf = tokenizers.Tokenizer.from_file(str(DEMO_TOKENIZER / "tokenizer.json"))
    from_dir = Tokenizer.from_hf_dir(DEMO_TOKENIZER)
    for text in corpus():
        assert demo.encode(text) == from_dir.encode(text) == hf.encode(text).ids, repr(text)


def test_decode_and_stream_round_trip(demo: Tokenizer) -> None:
    for text in corpus(120, seed=1):
        ids = demo.encode(text)
        assert demo.decode(ids) == text
        stream = demo.stream_decoder()
        pieces = [stream.feed(i) for i in ids]
        assert "".join(pieces) + stream.flush() == text
        assert not any("\ufffd" in p for p in pieces)


def test_special_tokens_parsing_and_skipping(demo: Tokenizer) -> None:
    eot = demo.specials["<|endoftext|>"]
    assert demo.encode("a<|endoftext|>b") == [demo.encode("a")[0], eot, demo.encode("b")[0]]
    assert eot not in demo.encode("a<|endoftext|>b", parse_special=False)
    assert demo.decode(demo.encode("a<|endoftext|>b"), skip_special=True) == "ab"
    assert eot in demo.eos_ids and not demo.add_bos


def test_hf_dir_reads_eos_and_bos() -> None:
    t = Tokenizer.from_hf_dir(DEMO_TOKENIZER)
    assert t.eos_ids == {0} and t.bos_id == 0 and t.vocab_size == 8192


# --- other gpt2 pre-tokenizers, in vocab-only GGUF files written here ------------------------------
TRAIN_TEXT = [line for _ in range(3) for line in FIXED] + [
    "The quick brown fox jumps over the lazy dog 1234567890 times. It's 3:45pm, isn't it?",
    "for i in range(100):\n    total += values[i] * weights[i]\n", "Ça va? Très bien, merci! 日本語 中文 🎉",
]


def write_vocab_gguf(path: Path, model: str, tokens: list[str], types: list[int], pre: str | None = None,
                     merges: list[str] | None = None, scores: list[float] | None = None,
                     bos: int | None = None, eos: int | None = None, add_bos: bool | None = None) -> Path:
    """A vocab-only GGUF file llama.cpp can open (a llama architecture header with no tensors)."""
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in dict(block_count=1, context_length=512, embedding_length=64, feed_forward_length=128).items():
        w.add_uint32(f"llama.{key}", value)
    w.add_uint32("llama.attention.head_count", 4)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model(model)
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def trained_byte_bpe() -> tuple[list[str], list[str]]:
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(TRAIN_TEXT, vocab_size=600, min_frequency=1, special_tokens=["<|begin|>", "<|end|>"])
    vocab = bpe.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    import json
    merges = json.loads(bpe._tokenizer.to_str())["model"]["merges"]
    return tokens, [m if isinstance(m, str) else " ".join(m) for m in merges]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2"])
def test_gpt2_pre_tokenizers_equal_llama_cpp(tmp_path: Path, pre: str) -> None:
    tokens, merges = trained_byte_bpe()
    types = [CONTROL if t.startswith("<|") and t.endswith("|>") else 1 for t in tokens]
    path = write_vocab_gguf(tmp_path / f"{pre}.gguf", "gpt2", tokens, types, pre=pre, merges=merges,
                            bos=tokens.index("<|begin|>"), eos=tokens.index("<|end|>"), add_bos=True)
    ours = Tokenizer.from_gguf(open_gguf_meta(path))
    assert ours.encode("hi")[0] == tokens.index("<|begin|>")
    assert_same_ids(ours, path, corpus(250, seed=2) + ["<|begin|>x<|end|>", "999999 12 1234 digits", "A\n\n\nB"])


def open_gguf_meta(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    return {f.name: f.contents() for f in reader.fields.values()}


def test_unknown_pre_tokenizer_is_refused() -> None:
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "made-up", "tokenizer.ggml.tokens": ["a"],
            "tokenizer.ggml.merges": []}
    with pytest.raises(TokenizerError, match="made-up"):
        Tokenizer.from_gguf(meta)


def test_missing_tokenizer_is_refused() -> None:
    with pytest.raises(TokenizerError, match="no tokenizer"):
        Tokenizer.from_gguf({"general.architecture": "llama"})


# --- llama-style SentencePiece BPE --------------------------------------------------------------------
def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """<unk>, <s>, </s>, 256 byte tokens, then pieces of a SentencePiece-style BPE trained here, scored
    by merge order (earlier merge = higher score), as SentencePiece BPE models are."""
    sp = tokenizers.SentencePieceBPETokenizer(add_prefix_space=True)
    sp.train_from_iterator(TRAIN_TEXT, vocab_size=500, min_frequency=1, special_tokens=[])
    import json
    model = json.loads(sp._tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    base = sorted(t for t in model["vocab"] if len(t) == 1)
    pieces = base + ["".join(m.split(" ")) for m in merges]
    pieces = list(dict.fromkeys(pieces))
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, CONTROL, CONTROL] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


def test_spm_equals_llama_cpp(tmp_path: Path) -> None:
    tokens, scores, types = spm_vocab()
    path = write_vocab_gguf(tmp_path / "spm.gguf", "llama", tokens, types, scores=scores, bos=1, eos=2)
    ours = Tokenizer.from_gguf(open_gguf_meta(path))
    assert ours.encode("hello")[0] == 1  # SPM files add BOS by default
    texts = [t for t in corpus(250, seed=3) if "<|endoftext|>" not in t] + ["<s>after bos", "x</s>y", "unknown ☃ chars"]
    assert_same_ids(ours, path, texts)
    for text in texts[:80]:
        assert ours.decode(ours.encode(text, add_special=False)) == text
