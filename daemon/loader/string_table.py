"""StringTable: a read-only sequence of strings packed in one UTF-8 buffer.

A GGUF vocabulary is 32K-256K short strings that live as long as the model. As Python str objects
(~50 bytes of header each, plus a list slot) the 100M benchmark file's 32000 tokens take 2.2 MB; packed,
with one end offset each, 0.3 MB. A string is decoded again each time it is read, which the
tokenizer does at build time and for the few tokens it has not cached.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import overload

import numpy as np


class StringTable(Sequence[str]):
    __slots__ = ("_blob", "_ends")

    def __init__(self, blob: bytes, ends: np.ndarray) -> None:
        """blob: the strings' UTF-8 bytes back to back (each checked by the caller); ends: where each ends."""
        self._blob = blob
        self._ends = ends.astype(np.uint32) if len(blob) < 1 << 32 else ends.astype(np.int64)

    @classmethod
    def of(cls, strings: Iterable[str]) -> StringTable:
        encoded = [s.encode() for s in strings]
        return cls(b"".join(encoded), np.cumsum([len(e) for e in encoded], dtype=np.int64))

    def __len__(self) -> int:
        return len(self._ends)

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self._ends)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"string {i} of a table of {n}")
        start = int(self._ends[i - 1]) if i else 0
        return self._blob[start : int(self._ends[i])].decode()

    def __iter__(self) -> Iterator[str]:
        blob, start = self._blob, 0
        for end in self._ends.tolist():
            yield blob[start:end].decode()
            start = end

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringTable):
            return self._blob == other._blob and np.array_equal(self._ends, other._ends)
        if isinstance(other, list):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are unhashable

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[:3])
        return f"StringTable([{head}{', ...' if len(self) > 3 else ''}], {len(self)} strings)"

    @property
    def nbytes(self) -> int:
        """The memory the strings take here."""
        return len(self._blob) + self._ends.nbytes
