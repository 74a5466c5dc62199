"""`ember pull NAME` and `ember list`: models by name, in huggingface_hub's cache (daemon/loader/hub.py)."""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

_QUANT = re.compile(r"(?i)(?:^|[-._])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)(?=[-.]|$)")


def add_hub_commands(sub: Any) -> None:
    pull = sub.add_parser("pull", help="download a model by name from the Hugging Face hub into its cache",
                          description="Download NAME (owner/repo or owner/repo:QUANT, as llama.cpp's -hf takes it) "
                                      "into huggingface_hub's cache, or resume a cut download, and print its path. "
                                      "HF_ENDPOINT, HF_HOME, HF_HUB_CACHE, HF_TOKEN and HF_HUB_OFFLINE apply.")
    pull.add_argument("name", metavar="NAME", help="owner/repo[:QUANT], e.g. Qwen/Qwen3-0.6B-GGUF:Q8_0")
    pull.set_defaults(func=_pull)
    listing = sub.add_parser("list", help="list the models in the Hugging Face cache, by name",
                             description="The GGUF files and model directories in huggingface_hub's cache, "
                                         "each with the name that serves it (ember serve --model NAME).")
    listing.set_defaults(func=_list)


def progress_for_stderr() -> Any:
    """None on a terminal (huggingface_hub draws its own bar), else lines on stderr."""
    from ember.daemon.loader.hub import DownloadLines

    if sys.stderr.isatty():
        return None
    return DownloadLines(lambda line: print(f"ember: {line}", file=sys.stderr, flush=True))


def _pull(args: argparse.Namespace) -> int:
    from ember.daemon.loader.hub import Hub, HubName, ModelNameError, fetch

    name = HubName.parse(args.name)
    if name is None:
        raise ModelNameError(f"{args.name}: not a model name (owner/repo or owner/repo:QUANT)")
    print(fetch(name, Hub.from_env(os.environ), progress_for_stderr()))
    return 0


def _list(args: argparse.Namespace) -> int:
    from huggingface_hub import scan_cache_dir

    from ember.daemon.loader.hub import Hub

    hub = Hub.from_env(os.environ)
    try:
        cache = scan_cache_dir(hub.cache_dir)
    except (OSError, ValueError):  # no cache yet (CacheNotFound is a FileNotFoundError)
        print(f"no models in {hub.where()}", file=sys.stderr)
        return 0
    rows = []
    for repo in sorted(cache.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model":
            continue
        for revision in repo.revisions:
            rows += _models_of(repo.repo_id, revision)
    if not rows:
        print(f"no models in {hub.where()}", file=sys.stderr)
        return 0
    width = max(len(name) for name, _, _ in rows)
    for name, size, path in rows:
        print(f"{name:<{width}}  {size / 1e6:>10.1f} MB  {path}")
    return 0


def _models_of(repo: str, revision: Any) -> list[tuple[str, int, Path]]:
    """(name, bytes, path) of each GGUF file of a cached revision, or of the revision as a model directory."""
    files = list(revision.files)
    ggufs = [f for f in files if f.file_name.lower().endswith(".gguf") and not f.file_name.lower().startswith("mmproj")]
    rows = []
    for f in ggufs:
        quant = _QUANT.search(Path(f.file_name).stem + ".")
        rows.append((f"{repo}:{quant.group(1)}" if quant else repo, f.size_on_disk, f.file_path))
    if not ggufs and any(f.file_name == "config.json" for f in files):
        rows.append((repo, sum(f.size_on_disk for f in files), Path(revision.snapshot_path)))
    return rows
