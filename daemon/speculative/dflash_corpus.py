"""The corpus the demo models were trained on, rebuilt from this machine's Python sources: the .py files
of the standard library and site-packages, shuffled with random.Random(0), files of 200 to 200,000
characters, every 50th file held out for validation, cut once `max_bytes` characters were taken — the
recipe of the team's train_demo.py (shared/models), with the target's own tokenizer instead of training
a new one, so the token ids are the target's. Plain Python + numpy (no torch).
"""
from __future__ import annotations

import glob
import os
import random
import site
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

EOT = "<|endoftext|>"
VAL_EVERY = 50  # every 50th file of the shuffled list is a validation file


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # uint16 token ids, documents separated by the end-of-text id
    val: np.ndarray
    n_bytes: int  # characters of source taken
    n_files: int


def source_files() -> list[str]:
    """The .py files of this interpreter's standard library and site-packages, in train_demo's order."""
    roots = [os.path.dirname(os.__file__), *site.getsitepackages()]
    files = [f for root in roots for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)]
    random.Random(0).shuffle(files)
    return files


def build_corpus(tokenizer_json: Path, max_bytes: int) -> Corpus:
    """Read the sources in order until more than `max_bytes` characters are taken, and tokenize them."""
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    eot = tokenizer.token_to_id(EOT)
    if eot is None:
        raise ValueError(f"{tokenizer_json} has no {EOT} token: it is not the demo models' tokenizer")
    splits: dict[str, list[str]] = {"train": [], "val": []}
    n_bytes = n_files = 0
    for i, path in enumerate(source_files()):
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not 200 <= len(text) <= 200_000:
            continue
        splits["val" if i % VAL_EVERY == 0 else "train"].append(text)
        n_bytes += len(text)
        n_files += 1
        if n_bytes > max_bytes:
            break
    train, val = (_encode(tokenizer, splits[name], eot) for name in ("train", "val"))
    return Corpus(train, val, n_bytes, n_files)


def _encode(tokenizer: Tokenizer, docs: list[str], eot: int) -> np.ndarray:
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(docs):
        ids.extend(encoding.ids)
        ids.append(eot)
    return np.array(ids, dtype=np.uint16)
