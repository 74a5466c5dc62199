"""Token ids equal llama.cpp's (same GGUF file) and Hugging Face's (same tokenizer.json), for the
tokenizer kinds real files use: gpt2-style byte-level BPE under every pre-tokenizer ember supports, and
llama-style SentencePiece BPE; plus decoding, streaming, end-of-generation ids and load errors."""
from __future__ import annotations

import random
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from ember.daemon.loader.demo_model import DEMO_MODEL
from ember.daemon.loader.gguf_file import open_gguf
from ember.daemon.text.tokenizer import PRE_TOKENIZERS, Tokenizer, TokenizerError
from tiny_models import DEMO_TOKENIZER
from tokenizer_fixtures import (FIXED, NORMAL, UNUSED, byte_bpe_vocab, corpus, gguf_metadata, spm_vocab,
                                whole_text_bpe_vocab, write_vocab_gguf)

tokenizers = pytest.importorskip("tokenizers")
try:
    import llama_cpp
except ImportError:  # the oracle: a guard only for the tests that compare with it (CI installs it)
    llama_cpp = None
_skip_without_llama_cpp = pytest.mark.skipif(llama_cpp is None, reason="llama-cpp-python (the oracle) is not installed")


def needs_llama_cpp(test: Any) -> Any:
    """An `oracle` test: against llama.cpp, skipped where it is not installed."""
    return pytest.mark.oracle(_skip_without_llama_cpp(test))


def llama(path: Path) -> Any:
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


def assert_ids_equal_llama_cpp(ours: Tokenizer, path: Path, texts: list[str], parse_special: bool = True) -> None:
    llm = llama(path)
    differ = [t for t in texts if ours.encode(t, parse_special=parse_special)
              != llm.tokenize(t.encode(), add_bos=True, special=parse_special)]
    assert not differ, f"{len(differ)} of {len(texts)} differ from llama.cpp, e.g. {differ[:3]!r}"


def llama_cpp_text(llm: Any, ids: list[int], special: bool) -> str:
    """llama.cpp's pieces of `ids`, joined (llama_token_to_piece; llama-cpp-python's detokenize cuts
    pieces longer than 32 bytes)."""
    buffer = (llama_cpp.ctypes.c_char * 256)()
    pieces = []
    for i in ids:
        n = llama_cpp.llama_token_to_piece(llm._model.vocab, i, buffer, len(buffer), 0, special)
        pieces.append(bytes(buffer[:n]))
    return b"".join(pieces).decode("utf-8", errors="replace")


def llama_cpp_eog_ids(path: Path) -> set[int]:
    llm = llama(path)  # held: the vocabulary lives as long as the model
    vocab = llm._model.vocab
    return {i for i in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, i)}


def assert_stream_equals_decode(tok: Tokenizer, ids: list[int], context: list[int] | None = None) -> None:
    stream = tok.stream_decoder(context=context or [])
    pieces = [stream.feed(i) for i in ids]
    assert not any("\ufffd" in p for p in pieces if "\ufffd" not in tok.decode(ids))
    expected = tok.decode(ids) if context is None else tok.decode(context + ids)[len(tok.decode(context)) :]
    assert "".join(pieces) + stream.flush() == expected


# --- gpt2 BPE from GGUF: the demo model, converted by llama.cpp's own converter -----------------------
@pytest.fixture(scope="module")
def demo() -> Tokenizer:
    return Tokenizer.from_gguf(open_gguf(DEMO_MODEL).metadata)


def test_the_bpe_is_built_once_by_the_first_encode(demo: Tokenizer) -> None:
    """Decoding, and a model fed token ids, never need the BPE (~2.7 MB for the demo's vocabulary): the
    first encode builds it, once, whichever of several threads starting together gets there first, and
    every thread gets the ids of a tokenizer built long before."""
    fresh = Tokenizer.from_gguf(open_gguf(DEMO_MODEL).metadata)
    ids = demo.encode(corpus(1)[0])
    assert fresh.decode(ids) == demo.decode(ids) and fresh._gguf is not None and fresh._gguf._bpe is None
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: (fresh.encode(corpus(1)[0]), id(fresh.core)), range(8)))
    assert [r[0] for r in results] == [ids] * 8 and len({r[1] for r in results}) == 1


@needs_llama_cpp
@pytest.mark.parametrize("parse_special", [True, False])
def test_demo_ids_equal_llama_cpp(demo: Tokenizer, parse_special: bool) -> None:
    assert_ids_equal_llama_cpp(demo, DEMO_MODEL, corpus(), parse_special)


def test_demo_ids_equal_hugging_face(demo: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    hf = tokenizers.Tokenizer.from_file(str(DEMO_TOKENIZER / "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    from_dir = Tokenizer.from_hf_dir(DEMO_TOKENIZER)
    for text in corpus():
        expected = hf.encode(text).ids
        assert demo.encode(text) == from_dir.encode(text) == expected == auto(text)["input_ids"], repr(text)


def test_hf_dir_matches_its_files(tmp_path: Path) -> None:
    t = Tokenizer.from_hf_dir(DEMO_TOKENIZER)
    assert (t.bos_id, t.eos_ids, t.add_bos, t.vocab_size, t.chat_template) == (0, {0}, False, 8192, None)
    literal = tokenizers.Tokenizer.from_file(str(DEMO_TOKENIZER / "tokenizer.json"))
    literal.encode_special_tokens = True  # HF's split_special_tokens
    for text in ["a<|endoftext|>b", "<|endoftext|>"]:
        assert t.encode(text, parse_special=False) == literal.encode(text).ids != t.encode(text)
    shutil.copytree(DEMO_TOKENIZER, tmp_path / "m")
    (tmp_path / "m" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert Tokenizer.from_hf_dir(tmp_path / "m").chat_template == "{{ messages[0]['content'] }}"


@needs_llama_cpp
def test_decode_equals_hugging_face_and_llama_cpp(demo: Tokenizer) -> None:
    """Random id sequences, broken UTF-8 included: the same text as HF's decode and llama.cpp's pieces."""
    hf = tokenizers.Tokenizer.from_file(str(DEMO_TOKENIZER / "tokenizer.json"))
    llm = llama(DEMO_MODEL)
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(demo.vocab_size) for _ in range(rng.randint(0, 12))]
        text = demo.decode(ids)
        assert text == hf.decode(ids, skip_special_tokens=False)
        assert text == llama_cpp_text(llm, ids, special=True)
        assert demo.decode(ids, skip_special=True) == hf.decode(ids, skip_special_tokens=True)


def test_decode_round_trip_and_stream(demo: Tokenizer) -> None:
    for text in corpus(150, seed=1):
        ids = demo.encode(text)
        assert demo.decode(ids) == text
        assert_stream_equals_decode(demo, ids)


def test_stream_holds_back_split_characters(demo: Tokenizer) -> None:
    ids = demo.encode("😀日本")  # characters this vocabulary splits into byte tokens
    stream = demo.stream_decoder()
    pieces = [stream.feed(i) for i in ids]
    assert len(ids) > 3 and "" in pieces and "".join(pieces) == "😀日本"
    rng = random.Random(2)  # and arbitrary ids, broken UTF-8 included
    for _ in range(200):
        assert_stream_equals_decode(demo, [rng.randrange(demo.vocab_size) for _ in range(rng.randint(1, 10))])


@needs_llama_cpp
def test_special_tokens(demo: Tokenizer) -> None:
    eot = demo.encode("<|endoftext|>")
    assert eot == [0] and demo.encode("a<|endoftext|>b") == demo.encode("a") + eot + demo.encode("b")
    assert 0 not in demo.encode("a<|endoftext|>b", parse_special=False)
    assert demo.decode(demo.encode("a<|endoftext|>b"), skip_special=True) == "ab"
    assert demo.eos_ids == llama_cpp_eog_ids(DEMO_MODEL) == {0}
    assert demo.encode("x") == demo.encode("x", add_special=False)  # the file says add_bos_token = false


# --- gpt2 BPE under every pre-tokenizer, in vocabulary-only GGUF files written here ---------------------
def byte_bpe_gguf(path: Path, pre: str | None, **keys: Any) -> Path:
    tokens, types, merges = byte_bpe_vocab()
    keys = dict(merges=merges, bos=tokens.index("<|begin|>"), eos=tokens.index("<|end|>"), add_bos=True) | keys
    return write_vocab_gguf(path, "gpt2", tokens, types, **({"pre": pre} if pre else {}), **keys)


# "|>xyzw<|" overlaps "<|end|>" and is longer: llama.cpp cuts it out first
SPECIALS_TEXT = ["<|begin|>x<|end|>", "a<|im_end|>\nb", "<think>hm</think>", "<|end|>xyzw<|end|>", "ab|>xyzw<|cd",
                 "<|im_end|>xyzw<|im_end|>", "999999 12 1234 digits", "A\n\n\nB"]
# one name per distinct pre-tokenizer (the first of its group)
REPRESENTATIVES = sorted({pre: name for name, pre in reversed(list(PRE_TOKENIZERS.items()))}.values())


@needs_llama_cpp
@pytest.mark.parametrize("pre", REPRESENTATIVES)
def test_pre_tokenizer_ids_equal_llama_cpp(tmp_path: Path, pre: str) -> None:
    path = byte_bpe_gguf(tmp_path / "v.gguf", pre)
    ours = Tokenizer.from_gguf(gguf_metadata(path))
    texts = corpus(250, seed=2, specials=("<|end|>", "<|im_end|>", "<think>", "|>xyzw<|")) + SPECIALS_TEXT
    assert_ids_equal_llama_cpp(ours, path, texts)
    assert_ids_equal_llama_cpp(ours, path, texts[::4] + SPECIALS_TEXT, parse_special=False)


@needs_llama_cpp
def test_every_pre_tokenizer_name_equals_llama_cpp(tmp_path: Path) -> None:
    """Each name llama.cpp knows maps to the regexes llama.cpp uses for it (texts that tell them apart)."""
    texts = FIXED[:40] + ["a1234b 12.5", "x  \n\n y", "Hello, World's", "日本語abc", "a(b)c", "I'M OK", "ǅA"]
    for name in sorted(PRE_TOKENIZERS):
        path = byte_bpe_gguf(tmp_path / f"{name}.gguf", name)
        assert_ids_equal_llama_cpp(Tokenizer.from_gguf(gguf_metadata(path)), path, texts)


# what the regexes tell apart, one place at a time (a whole text is one token of the vocabulary below):
# cased letters of many scripts (DeepSeek LLM spells them out; not ƻ or ʔ), ASCII, CJK and fullwidth
# punctuation, spaces (non-ASCII ones inside CJK ranges among them), digits, newlines, emoji
CUT_TEXTS = ["Ω𐐀", "ℂ\u2126", "ǅ𞤀", "ꙀḀ", "µØ", "Øƻø", "ʔx", "Ꮳherokee", "ﬁx", "Kelvin", "ＡＢＣ！", "ａｂ：",
             "！\u3000！", "a\u3000b", "。\u3000。", "\u3000\u3000", "日\u2003本", "한\u2000국", "中\u1680文", "テ\u3000ス",
             "「引用」！？", "中文，标点！", "‘q’", "“dq” „low“ …", "trailing   ", "x  ", "  lead", "a \t", "end\u3000",
             "a\r\nb", "\r\n\r\n", "x\n", "123", "١٢٣", "½", "Ⅻ", "3.14", "12abc", "a😀b", "🎉🎉", "don't", "WE'LL",
             "\u0085x", "x\u00a0y", "x\u1680y", "x\u205fz"]


@needs_llama_cpp
@pytest.mark.parametrize("pre", sorted({*REPRESENTATIVES, "deepseek-llm"}))  # named: tested even if missing
def test_pre_tokenizer_cuts_equal_llama_cpp(tmp_path: Path, pre: str) -> None:
    """The words each pre-tokenizer cuts equal llama.cpp's, not only where a merge is at stake: each text
    is one token of the vocabulary, so a cut that one makes and the other does not changes the ids."""
    texts = corpus(150, seed=8, specials=()) + CUT_TEXTS
    tokens, merges = whole_text_bpe_vocab(tuple(texts))
    path = write_vocab_gguf(tmp_path / "v.gguf", "gpt2", tokens, [NORMAL] * len(tokens), merges=merges, pre=pre,
                            add_bos=False)
    assert_ids_equal_llama_cpp(Tokenizer.from_gguf(gguf_metadata(path)), path, texts)


@needs_llama_cpp
@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe"])
def test_tokens_no_merge_makes_equal_llama_cpp(tmp_path: Path, pre: str) -> None:
    """A vocabulary padded as llama.cpp's converter pads one ([PAD<id>], unused) and holding a token no
    merge makes: where only merges make tokens (gpt-2) the BPE leaves them out and the ids are still
    llama.cpp's; where a word that is a token is taken whole (llama-bpe) the BPE keeps them all."""
    tokens, types, merges = byte_bpe_vocab()
    assert "Ġxylophone" not in tokens
    padded = [*tokens, "Ġxylophone", *(f"[PAD{i}]" for i in range(len(tokens) + 1, 1024))]
    padded_types = [*types, NORMAL, *[UNUSED] * (len(padded) - len(types) - 1)]
    path = write_vocab_gguf(tmp_path / "v.gguf", "gpt2", padded, padded_types, merges=merges, pre=pre,
                            bos=tokens.index("<|begin|>"), add_bos=True)
    ours = Tokenizer.from_gguf(gguf_metadata(path))
    texts = corpus(100, seed=9) + ["a xylophone", " xylophone!", "[PAD1000]", "x [PAD700] y", "PAD"]
    assert_ids_equal_llama_cpp(ours, path, texts)
    in_bpe = ours.core.get_vocab(with_added_tokens=False)
    assert ("Ġxylophone" in in_bpe) == ("[PAD1000]" in in_bpe) == (pre == "llama-bpe")
    assert len(in_bpe) == len(padded) if pre == "llama-bpe" else len(in_bpe) < len(tokens)
    assert all(in_bpe[t] == padded.index(t) for t in list(in_bpe)[::7])


@needs_llama_cpp
@pytest.mark.parametrize("pre", [None, "gpt-2", "llama-bpe", "tekken"])
def test_add_bos_default_when_the_file_does_not_say(tmp_path: Path, pre: str | None) -> None:
    path = byte_bpe_gguf(tmp_path / "v.gguf", pre, add_bos=None)
    ours = Tokenizer.from_gguf(gguf_metadata(path))
    assert ours.encode("hi") == llama(path).tokenize(b"hi", add_bos=True, special=True)


@needs_llama_cpp
def test_end_of_generation_ids_equal_llama_cpp(tmp_path: Path) -> None:
    path = byte_bpe_gguf(tmp_path / "v.gguf", "qwen2")
    ours = Tokenizer.from_gguf(gguf_metadata(path))
    tokens = byte_bpe_vocab()[0]
    assert ours.eos_ids == llama_cpp_eog_ids(path) == {tokens.index("<|end|>"), tokens.index("<|im_end|>")}


@needs_llama_cpp
def test_decode_as_llama_cpp_writes_pieces(tmp_path: Path) -> None:
    """Control tokens are dropped by skip_special, user-defined ones (text) are not."""
    path = byte_bpe_gguf(tmp_path / "v.gguf", "llama-bpe")
    ours, llm = Tokenizer.from_gguf(gguf_metadata(path)), llama(path)
    for text in SPECIALS_TEXT + corpus(60, seed=3):
        ids = ours.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special=skip) == llama_cpp_text(llm, ids, not skip), (text, skip)


# --- llama-style SentencePiece ----------------------------------------------------------------------------
def spm_gguf(path: Path, **keys: Any) -> Path:
    tokens, types, scores = spm_vocab()
    return write_vocab_gguf(path, "llama", tokens, types, **(dict(scores=scores, bos=1, eos=2) | keys))


SPM_TEXTS = ["<s>after bos", "x</s>y", "unknown ☃ chars", "a<start_of_turn>user\nhi", "     five", "x    y"]


@needs_llama_cpp
@pytest.mark.parametrize("space_prefix", [True, False])
def test_spm_ids_equal_llama_cpp(tmp_path: Path, space_prefix: bool) -> None:
    path = spm_gguf(tmp_path / "spm.gguf", add_space_prefix=space_prefix)
    ours = Tokenizer.from_gguf(gguf_metadata(path))
    assert ours.encode("hello")[0] == 1  # SentencePiece files add BOS unless they say otherwise
    texts = corpus(300, seed=4, specials=("<s>", "</s>", "<start_of_turn>")) + SPM_TEXTS
    assert_ids_equal_llama_cpp(ours, path, texts)
    assert_ids_equal_llama_cpp(ours, path, texts[::3] + SPM_TEXTS, parse_special=False)


def test_spm_decode_round_trip_and_stream(tmp_path: Path) -> None:
    ours = Tokenizer.from_gguf(gguf_metadata(spm_gguf(tmp_path / "spm.gguf")))
    for text in [t for t in corpus(120, seed=5, specials=()) if "<|endoftext|>" not in t]:  # a space follows
        ids = ours.encode(text, add_special=False)
        assert ours.decode(ids) == text
        assert_stream_equals_decode(ours, ids)
    # a continuation keeps the space its first token starts with; alone, the text would lose it
    prompt, more = ours.encode("Once upon a"), ours.encode("time there", add_special=False)  # ▁time ▁there
    stream = ours.stream_decoder(context=prompt)
    assert "".join(stream.feed(i) for i in more) + stream.flush() == " time there" != ours.decode(more)
    assert_stream_equals_decode(ours, more, context=prompt)


@needs_llama_cpp
@pytest.mark.parametrize("drop_chars", ["▁", "*"])
def test_spm_merges_characters_that_are_not_tokens(tmp_path: Path, drop_chars: str) -> None:
    """llama.cpp merges "▁" + "t" into "▁t" though "▁" (or also "t") is no token; only the characters
    left unmerged that are no token become byte tokens."""
    tokens, types, scores = spm_vocab(drop_chars)
    path = write_vocab_gguf(tmp_path / "spm.gguf", "llama", tokens, types, scores=scores, bos=1, eos=2)
    ours = Tokenizer.from_gguf(gguf_metadata(path))
    assert "▁" not in tokens and ("t" in tokens) == (drop_chars != "*")
    assert [tokens[i] for i in ours.encode("return the text", add_special=False)] == ["▁return", "▁the", "▁text"]
    texts = corpus(300, seed=6, specials=("<s>", "</s>", "<start_of_turn>")) + SPM_TEXTS + [
        "the 日本語 text", "x  y  ", " ☃ snow", "abc\n\ndef", "  leading", "Ünïcödé café", "1,000,000 😀😀"]
    assert_ids_equal_llama_cpp(ours, path, texts)
    assert_ids_equal_llama_cpp(ours, path, texts[::3] + SPM_TEXTS, parse_special=False)
    llm = llama(path)  # characters left unmerged decode to their bytes (a lone "▁" to "▁"), as in llama.cpp
    for text in texts[:60] + ["x  y  ", "unknown ☃ chars"]:
        ids = ours.encode(text)
        assert ours.decode(ids) == llama_cpp_text(llm, ids, special=True), text


@needs_llama_cpp
def test_spm_end_of_generation_ids_equal_llama_cpp(tmp_path: Path) -> None:
    path = spm_gguf(tmp_path / "spm.gguf")
    eos_ids = Tokenizer.from_gguf(gguf_metadata(path)).eos_ids
    assert eos_ids == llama_cpp_eog_ids(path) and 2 in eos_ids


# --- errors -----------------------------------------------------------------------------------------------
def demo_meta(**changes: Any) -> dict[str, Any]:
    meta = {k: v for k, v in open_gguf(DEMO_MODEL).metadata.items() if k.startswith("tokenizer.")}
    return {k: v for k, v in (meta | changes).items() if v is not None}


@pytest.mark.parametrize("changes, message", [
    ({"tokenizer.ggml.model": None}, "no tokenizer"),
    ({"tokenizer.ggml.tokens": None}, "no tokenizer"),
    ({"tokenizer.ggml.model": "bert"}, "unsupported tokenizer model 'bert'"),
    ({"tokenizer.ggml.pre": "made-up"}, "unsupported pre-tokenizer 'made-up'"),
    ({"tokenizer.ggml.tokens": [1, 2, 3]}, "not a list of strings"),
    ({"tokenizer.ggml.tokens": ["a", "b", "a"]}, "duplicate token"),
    ({"tokenizer.ggml.token_type": [1, 1]}, "token_type is not a list of 8192 numbers"),
    ({"tokenizer.ggml.merges": None}, "merges is missing"),
    ({"tokenizer.ggml.merges": "a b"}, "merges is not a list of strings"),
    ({"tokenizer.ggml.bos_token_id": None, "tokenizer.ggml.add_bos_token": True}, "bos_token_id is missing"),
])
def test_bad_gguf_metadata_is_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_gguf(demo_meta(**changes))


def test_bad_hf_dir_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot read"):
        Tokenizer.from_hf_dir(tmp_path)
    shutil.copy(DEMO_TOKENIZER / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("[1,")
    with pytest.raises(TokenizerError, match="invalid JSON"):
        Tokenizer.from_hf_dir(tmp_path)


def test_ids_outside_the_vocabulary_are_refused(demo: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        demo.decode([demo.vocab_size])
    assert demo.token_text(0) == "<|endoftext|>"
