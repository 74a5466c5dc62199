"""Models by name: `owner/repo` or `owner/repo:QUANT` on the Hugging Face hub, fetched into
huggingface_hub's own cache and served from there.

A name is what llama.cpp's `-hf` takes: a GGUF repository and, after the colon, the quantization whose
file to take (`Qwen/Qwen3-8B-GGUF:Q4_K_M`; without one, Q4_K_M where the repository has it, else its
only GGUF file). A repository without GGUF files is a Hugging Face model directory: its config,
tokenizer and safetensors files are fetched. An existing local path always wins over a name.

Files land in huggingface_hub's cache, in its layout, shared with every other tool that uses it
(`HF_HOME`, `HF_HUB_CACHE`); huggingface_hub asks the hub (`HF_ENDPOINT`: a mirror, or the tests' local
server) and moves the bytes. A cut download goes on where it stopped on the next run (_download);
offline use (`HF_HUB_OFFLINE=1`, or a hub that cannot be reached) takes the name's cached files. On a terminal it draws its own
progress bar; elsewhere (systemd, a pipe) `progress` gets the bytes as they come and DownloadLines
makes a few log lines of them.
"""
from __future__ import annotations

import fcntl
import fnmatch
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's choice where a name gives none
# a Hugging Face directory's files that ember reads (hf_dir.py); weights only as safetensors
HF_DIR_PATTERNS = ("*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt")
_NAME = re.compile(r"^(?:hf\.co/|huggingface\.co/)?([A-Za-z0-9][\w.-]*/[\w.-]+?)(?::([\w.-]+))?$")
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$")

Progress = Callable[[str, int, "int | None"], None]  # (file, bytes so far, bytes in all or None)


class ModelNameError(OSError):
    """A model name that cannot be resolved, said in one line (no such repository or quantization, no
    network and nothing cached)."""


@dataclass(frozen=True)
class HubName:
    repo: str  # owner/name
    quant: str | None = None

    @classmethod
    def parse(cls, text: str) -> HubName | None:
        """The name in `text`, or None where it is not one (a path: absolute, relative with ./ or more
        than one slash, or ending in .gguf)."""
        if text.startswith((".", "/", "~")) or text.lower().endswith(".gguf"):
            return None
        match = _NAME.match(text)
        return None if match is None else cls(match.group(1), match.group(2))

    def __str__(self) -> str:
        return self.repo if self.quant is None else f"{self.repo}:{self.quant}"


@dataclass(frozen=True)
class Hub:
    """Where names resolve: huggingface_hub's endpoint and cache, as the environment sets them."""

    endpoint: str = "https://huggingface.co"
    cache_dir: Path | None = None  # None: huggingface_hub's own (HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub)
    offline: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Hub:
        cache = env.get("HF_HUB_CACHE") or (str(Path(env["HF_HOME"]) / "hub") if env.get("HF_HOME") else None)
        offline = env.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        return cls((env.get("HF_ENDPOINT") or cls.endpoint).rstrip("/"), Path(cache) if cache else None, offline)

    def where(self) -> str:
        from huggingface_hub import constants

        return str(self.cache_dir or constants.HF_HUB_CACHE)


def resolve_model(text: str, hub: Hub, progress: Progress | None = None) -> Path:
    """The local path of a model named by `text`: the path itself where it exists or is not a name
    (opening it then says what is wrong), else the hub's file or directory for the name, fetched
    unless cached. ModelNameError says why a name cannot be had."""
    path = Path(text).expanduser()
    name = None if path.exists() else HubName.parse(text)
    return path if name is None else fetch(name, hub, progress)


def fetch(name: HubName, hub: Hub, progress: Progress | None = None) -> Path:
    """The name's GGUF file, or its model directory, in the hub's cache: fetched (or its cut download
    resumed), or where the hub cannot be reached (or hub.offline), as cached."""
    if hub.offline:
        return _cached(name, hub, "offline (HF_HUB_OFFLINE)")
    try:
        files = _repo_files(name, hub)
    except ModelNameError:
        raise
    except Exception as err:  # noqa: BLE001 (httpx's and huggingface_hub's transport errors alike)
        return _cached(name, hub, f"cannot reach {hub.endpoint}: {_reason(err)}")
    gguf = pick_gguf(name, files)
    try:
        if gguf is not None:
            return _download(name, hub, gguf, progress)
        if name.quant is not None:
            raise ModelNameError(f"{name}: the repository has no GGUF files, so no quantization to pick: "
                                 f"name it without ':{name.quant}'")
        return _download_dir(name, hub, files, progress)
    except ModelNameError:
        raise
    except Exception as err:  # noqa: BLE001
        raise ModelNameError(f"{name}: the download failed: {_reason(err)} (run it again: it resumes)") from None


def pick_gguf(name: HubName, files: Sequence[str]) -> str | None:
    """The repository file the name means: the GGUF of its quantization (or DEFAULT_QUANT, or the
    only one); None where the repository has no GGUF files (a model directory). ModelNameError for a
    quantization it lacks, a choice it cannot make, or a split file."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf") and not Path(f).name.lower().startswith("mmproj"))
    if not ggufs:
        return None
    quant = name.quant or (DEFAULT_QUANT if any(_has_quant(f, DEFAULT_QUANT) for f in ggufs) else None)
    matching = [f for f in ggufs if quant is None or _has_quant(f, quant)]
    if not matching:
        raise ModelNameError(f"{name}: no GGUF file of {quant} in the repository; it has {_quants(ggufs)}")
    if len(matching) > 1 and all(_SPLIT.search(f) for f in matching):
        raise ModelNameError(f"{name}: the model is split over {len(matching)} GGUF files, which ember does not "
                             f"read yet (llama-gguf-split --merge makes one file)")
    if len(matching) > 1:
        raise ModelNameError(f"{name}: {len(matching)} GGUF files match; name one quantization: {_quants(matching)}")
    return matching[0]


def _has_quant(path: str, quant: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(quant)}(?![A-Za-z0-9_])", path, re.IGNORECASE) is not None


def _quants(files: Sequence[str]) -> str:
    return ", ".join(Path(f).name for f in files)


def _repo_files(name: HubName, hub: Hub) -> list[str]:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        info = HfApi(endpoint=hub.endpoint).model_info(name.repo, timeout=_timeout())
    except GatedRepoError:
        raise ModelNameError(f"{name}: the repository is gated: accept its terms on the hub and set HF_TOKEN") from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise ModelNameError(f"{name}: no such local path, and no such model on {hub.endpoint} (or it is private: "
                             f"set HF_TOKEN)") from None
    return [s.rfilename for s in info.siblings or ()]


def _download(name: HubName, hub: Hub, filename: str, progress: Progress | None) -> Path:
    """The file in the hub's cache, in huggingface_hub's layout (blobs/<etag>, snapshots/<commit>/<file>,
    refs/main), so that its tools and offline runs find it. Fetched here rather than by hf_hub_download,
    which since huggingface_hub 1.x starts a cut download over: the bytes go to blobs/<etag>.incomplete,
    which the next run continues with a range request."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    meta = get_hf_file_metadata(hf_hub_url(name.repo, filename, endpoint=hub.endpoint), timeout=_timeout())
    if not meta.commit_hash or not meta.etag:
        raise ModelNameError(f"{name}: {hub.endpoint} named no commit or ETag for {filename}: not a hub's answer")
    storage = Path(hub.where()) / f"models--{name.repo.replace('/', '--')}"
    blob = storage / "blobs" / meta.etag
    if not blob.exists():
        locks = storage.parent / ".locks" / storage.name  # where huggingface_hub locks the same blob
        locks.mkdir(parents=True, exist_ok=True)
        blob.parent.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{meta.etag}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process fetching it: wait, then find it done
            if not blob.exists():
                _fetch_blob(meta.location, blob, meta.size, Path(filename).name, progress, http_get, build_hf_headers())
    pointer = storage / "snapshots" / meta.commit_hash / filename
    pointer.parent.mkdir(parents=True, exist_ok=True)
    if not pointer.exists():
        pointer.unlink(missing_ok=True)  # a dangling link
        pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / "main").write_text(meta.commit_hash)
    return pointer


def _fetch_blob(url: str, blob: Path, size: int | None, shown: str, progress: Progress | None, http_get: Any,
                headers: dict[str, str]) -> None:
    partial = blob.with_name(blob.name + ".incomplete")
    have = partial.stat().st_size if partial.exists() else 0
    if size is not None and have > size:  # not a prefix of this file
        partial.unlink()
        have = 0
    with open(partial, "ab") as f:
        http_get(url, f, resume_size=have, headers=headers, expected_size=size, displayed_filename=shown,
                 tqdm_class=None if progress is None else _bar_class(progress))
    if size is not None and partial.stat().st_size != size:
        raise ModelNameError(f"{shown}: got {partial.stat().st_size} bytes of {size}")
    os.replace(partial, blob)


def _download_dir(name: HubName, hub: Hub, files: Sequence[str], progress: Progress | None) -> Path:
    """A model directory's files that ember reads (HF_DIR_PATTERNS), each as _download fetches it."""
    wanted = [f for f in files if any(fnmatch.fnmatch(Path(f).name, p) for p in HF_DIR_PATTERNS) and "/" not in f]
    if "config.json" not in wanted:
        raise ModelNameError(f"{name}: neither GGUF files nor a config.json in the repository: not a model ember reads")
    paths = [_download(name, hub, f, progress) for f in wanted]
    return paths[0].parent


def _cached(name: HubName, hub: Hub, why: str) -> Path:
    """The name's files as the cache holds them (its main revision), or ModelNameError saying `why`."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(name.repo, cache_dir=hub.cache_dir, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        raise ModelNameError(f"{name}: {why}, and it is not in the cache ({hub.where()})") from None
    files = [str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()]
    try:
        gguf = pick_gguf(name, files)
    except ModelNameError:
        cached = _quants([f for f in files if f.lower().endswith(".gguf")])
        raise ModelNameError(f"{name}: {why}, and it is not in the cache ({hub.where()} has {cached} of "
                             f"{name.repo})") from None
    if gguf is not None:
        return snapshot / gguf
    if name.quant is not None or not (snapshot / "config.json").exists():
        raise ModelNameError(f"{name}: {why}, and it is not in the cache ({hub.where()})")
    return snapshot


def _timeout() -> float:
    return float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or 10)


def _reason(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _bar_class(progress: Progress) -> type:
    """A tqdm class huggingface_hub draws its transfers with, that hands `progress` the bytes instead
    of drawing (a plain tqdm subclass: huggingface_hub passes it no `disable` of its own)."""
    from tqdm import tqdm

    class Bar(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)
            super().__init__(*args, **{**kwargs, "file": _Discard(), "disable": False})

        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            progress(str(self.desc).rstrip(": "), int(self.n), None if self.total is None else int(self.total))
            return shown

    return Bar


class _Discard:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


class DownloadLines:
    """A download's progress as a few lines (for a log or a pipe): its first bytes, each further tenth
    of the file or `every` seconds, and its end; `emit(line)` writes one."""

    def __init__(self, emit: Callable[[str], None], every: float = 30.0) -> None:
        self.emit, self.every = emit, every
        self._last: dict[str, tuple[int, float]] = {}  # per file: the tenth and the time of its last line
        self._finished: set[str] = set()

    def __call__(self, file: str, done: int, total: int | None) -> None:
        finished = bool(total) and done >= total
        tenth = 10 * done // total if total else 0
        last, now = self._last.get(file), time.monotonic()
        if file in self._finished or (last is not None and not finished and tenth == last[0]
                                       and now - last[1] < self.every):
            return
        self._last[file] = (tenth, now)
        if finished:
            self._finished.add(file)
        of = f" of {_mb(total)} ({100 * done // total}%)" if total else ""
        self.emit(f"downloading {file}: {_mb(done)}{of}")


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
