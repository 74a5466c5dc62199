"""TokenizePool: large texts are tokenized (and long id lists detokenized) in worker processes, so that
no thread of the daemon ever waits for the GIL while a big text is encoded.

`tokenizers`' `Tokenizer.encode` holds the GIL for the whole call (measured: a 3 MB encode stalled a
CPU-bound Python thread beside it for 2.5 s), and the engine thread takes the GIL between its kernel
calls: a big prompt tokenized in the daemon's process stalled every stream. Its `encode_batch`
releases the GIL, but the GGUF path's own Python work (cutting out special tokens, byte fallbacks)
and the Encoding's memory (hundreds of MB for a 3 MB text, kept by the allocator afterwards) would
still be the daemon's. So texts over `inline_bytes` go to a process pool (spawn context), whose
workers load each model's tokenizer themselves from the model's path, and the callers tokenize
smaller ones in their own thread (cheaper than a round trip to a worker).

Only what the daemon built crosses to a worker (a path, a str or a list of ints, a fingerprint) and
only a list of ints or a str comes back: nothing a client sent is ever unpickled by the daemon.
Spawned workers import the parent's main module as multiprocessing does (not a `__main__` module:
`python -m ember.client.cli` and the `ember` command are safe; a script must guard its main code).
"""
from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, TypeVar

from ember.daemon.text.tokenizer import Tokenizer

T = TypeVar("T")

# texts up to this are encoded in the caller's thread, holding the GIL ~5 ms at most; a round trip to a
# worker costs ~0.5 ms more than encoding in place up to ~8 KiB (docs/daemon.md, "Tokenizing")
INLINE_BYTES = 8 << 10
INLINE_IDS = 16384  # id lists up to this are decoded in the caller's thread (~6 ms for the demo model)
_ORPHAN_CHECK = 1.0  # seconds between a worker's looks at whether the daemon is still there
# a text the worker encodes to check that it loaded the tokenizer the daemon serves with (a model file
# replaced on disk since the daemon loaded it would give other ids)
_PROBE = "Hello, world! 123 \n\t x=[1, 2]; ünïcödé 漢字 😀 <|im_end|></s>"


class TokenizerChanged(RuntimeError):
    """The worker's tokenizer, loaded from the model's path, differs from the daemon's."""


@functools.cache
def fingerprint(tokenizer: Tokenizer) -> tuple[int, tuple[int, ...]]:
    """What a worker's tokenizer must match: the vocabulary's size and the ids of a probe text."""
    return tokenizer.vocab_size, tuple(tokenizer.encode(_PROBE))


class TokenizePool:
    def __init__(self, workers: int | None = None, inline_bytes: int = INLINE_BYTES,
                 inline_ids: int = INLINE_IDS) -> None:
        self.inline_bytes, self.inline_ids = inline_bytes, inline_ids
        self._workers = workers or _default_workers()
        self._executor: ProcessPoolExecutor | None = None  # started on first use: most daemons never need it
        self._lock = threading.Lock()  # the I/O thread and the text thread both submit
        self._closed = False

    def encode(self, path: Path, tokenizer: Tokenizer, text: str, add_special: bool) -> Future[list[int]]:
        """`tokenizer.encode(text, add_special)` in a worker, which loads the tokenizer from `path`."""
        return self._submit(_encode, str(path), fingerprint(tokenizer), text, add_special)

    def decode(self, path: Path, tokenizer: Tokenizer, ids: Sequence[int]) -> Future[str]:
        """`tokenizer.decode(ids)` in a worker."""
        return self._submit(_decode, str(path), fingerprint(tokenizer), list(ids))

    def close(self) -> None:
        """Stop the workers (a text being encoded is finished first: at most a few seconds)."""
        with self._lock:
            self._closed = True
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)

    def _submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        with self._lock:
            if self._closed:
                raise RuntimeError("the tokenize pool is closed")
            if self._executor is None:
                self._executor = self._start()
            try:
                return self._executor.submit(fn, *args)
            except BrokenProcessPool:  # a worker died (killed, out of memory): start afresh
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = self._start()
                return self._executor.submit(fn, *args)

    def _start(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self._workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_worker_setup)


def _default_workers() -> int:
    # one core stays with the engine's kernels, one with the I/O and text threads; beyond 4 cores a
    # second worker keeps one client's long text from delaying another's
    return 1 if (os.cpu_count() or 1) < 4 else 2


# --- in the worker process ---------------------------------------------------------------------------
_tokenizers: dict[str, Tokenizer] = {}


def _worker_setup() -> None:
    # the daemon decides when its workers stop (a terminal's ^C or systemd's SIGTERM reach the whole
    # group): they finish the text at hand and exit when the pool shuts down or the daemon is gone
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with, args=(os.getppid(),), name="ember-orphan-watch", daemon=True).start()


def _exit_with(parent: int) -> None:
    """A daemon killed outright never shuts its pool down, and a worker holds both ends of its own
    queue (no EOF comes): it exits once its parent is gone."""
    while os.getppid() == parent:
        time.sleep(_ORPHAN_CHECK)
    os._exit(0)


def _tokenizer(path: str, expected: tuple[int, tuple[int, ...]]) -> Tokenizer:
    if path not in _tokenizers:
        from ember.daemon.loader.model_file import open_model_file  # the worker's only heavy import

        mf = open_model_file(path)
        tokenizer = Tokenizer.from_gguf(mf.metadata) if mf.format == "gguf" else Tokenizer.from_hf_dir(mf.path)
        if fingerprint(tokenizer) != expected:
            raise TokenizerChanged(f"{path} changed on disk since the daemon loaded it: restart the daemon")
        _tokenizers[path] = tokenizer
    return _tokenizers[path]


def _encode(path: str, expected: tuple[int, tuple[int, ...]], text: str, add_special: bool) -> list[int]:
    return _tokenizer(path, expected).encode(text, add_special=add_special)


def _decode(path: str, expected: tuple[int, tuple[int, ...]], ids: list[int]) -> str:
    return _tokenizer(path, expected).decode(ids)
