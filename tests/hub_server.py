"""A local HTTP server in the Hugging Face hub's layout, for huggingface_hub to download from
(HF_ENDPOINT=server.url): these machines have no internet.

It serves what ember's fetch (daemon/loader/hub.py) asks of the hub through huggingface_hub: a repository's info
(`/api/models/{repo}[/revision/{rev}]`, its files as `siblings`) and its files
(`/{repo}/resolve/{rev}/{path}`: HEAD with the commit, ETag and size; GET with byte ranges), with the
hub's error codes for a repository or file it lacks. `stall_after` makes every full (not ranged) GET
stop after that many bytes and hang until `release()`, for a download cut mid-file; `requests`
records each request's method, path and Range header.
"""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class HubServer:
    repos: dict[str, dict[str, bytes]]  # repo -> path in the repo -> bytes
    stall_after: int | None = None
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    _released: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> HubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        self.httpd.shutdown()
        self.httpd.server_close()

    def release(self) -> None:
        """Stalled transfers go on, and no later one stalls."""
        self.stall_after = None
        self._released.set()

    def add_files(self, repo: str, folder: Path, names: list[str]) -> None:
        self.repos.setdefault(repo, {}).update({n: (folder / n).read_bytes() for n in names})


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def end_headers(self) -> None:
            # no kept-alive connections: a pooled one would go on answering after the server stops
            self.send_header("Connection", "close")
            super().end_headers()

        def do_HEAD(self) -> None:  # noqa: N802 (http.server's names)
            self._serve(body=False)

        def do_GET(self) -> None:  # noqa: N802
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Range")))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"]:
                return self._info(parts[2:], body)
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._file("/".join(parts[:2]), "/".join(parts[4:]), body)
            self._error(404, "EntryNotFound")

        def _info(self, parts: list[str], body: bool) -> None:
            repo = "/".join(parts[:2])
            if repo not in hub.repos:
                return self._error(404, "RepoNotFound")
            info = {"id": repo, "modelId": repo, "sha": COMMIT, "private": False, "tags": [],
                    "siblings": [{"rfilename": name} for name in sorted(hub.repos[repo])]}
            data = json.dumps(info).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _file(self, repo: str, name: str, body: bool) -> None:
            if repo not in hub.repos:
                return self._error(404, "RepoNotFound")
            data = hub.repos[repo].get(name)
            if data is None:
                return self._error(404, "EntryNotFound")
            start = 0
            ranged = self.headers.get("Range")
            if ranged and ranged.startswith("bytes="):
                start = int(ranged[len("bytes="):].split("-")[0])
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(data) - start))
            self.send_header("Accept-Ranges", "bytes")
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            stall = hub.stall_after
            if stall is not None and not start:
                self.wfile.write(data[:stall])
                self.wfile.flush()
                hub._released.wait()
                self.wfile.write(data[stall:])
            else:
                self.wfile.write(data[start:])

        def _error(self, status: int, code: str) -> None:
            data = json.dumps({"error": code}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

    return Handler
