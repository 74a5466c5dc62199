"""Models by name (daemon/loader/hub.py, `ember pull`, `ember list`, ember.load("owner/repo:QUANT")),
against a local server in the hub's layout (tests/hub_server.py): these machines have no internet."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ember.daemon.loader.demo_model import DEMO_MODEL
from ember.daemon.loader.hub import DownloadLines, Hub, HubName, ModelNameError, fetch, pick_gguf, resolve_model
from hub_server import HubServer

DEMO_BYTES = DEMO_MODEL.read_bytes()
GGUF_REPO = "ember/demo-GGUF"


def gguf_repo() -> dict[str, bytes]:
    return {"ember-demo-Q8_0.gguf": DEMO_BYTES, "ember-demo-Q4_K_M.gguf": DEMO_BYTES[:1000], "README.md": b"# demo"}


def hub_for(server: HubServer, tmp_path: Path, offline: bool = False) -> Hub:
    return Hub(server.url, tmp_path / "hub", offline)


def cli(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ember.client.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def hub_env(server: HubServer, tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "HF_ENDPOINT": server.url, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "0"}


@pytest.mark.parametrize("text, want", [
    ("Qwen/Qwen3-8B-GGUF:Q4_K_M", HubName("Qwen/Qwen3-8B-GGUF", "Q4_K_M")),
    ("Qwen/Qwen3-0.6B", HubName("Qwen/Qwen3-0.6B")),
    ("hf.co/unsloth/Qwen3-8B-GGUF:UD-Q4_K_XL", HubName("unsloth/Qwen3-8B-GGUF", "UD-Q4_K_XL")),
    ("model.gguf", None), ("./a/b", None), ("/models/a", None), ("~/a/b", None), ("a/b/c", None), ("plain", None),
])
def test_what_is_a_name(text: str, want: HubName | None) -> None:
    assert HubName.parse(text) == want


def test_which_file_a_name_means() -> None:
    files = ["Qwen3-8B-Q4_K_M.gguf", "Qwen3-8B-Q4_K.gguf", "Qwen3-8B-Q8_0.gguf", "mmproj-Qwen3-8B-F16.gguf", "README.md"]
    assert pick_gguf(HubName("q/r", "q8_0"), files) == "Qwen3-8B-Q8_0.gguf"  # case does not matter
    assert pick_gguf(HubName("q/r", "Q4_K"), files) == "Qwen3-8B-Q4_K.gguf"  # not Q4_K_M's file
    assert pick_gguf(HubName("q/r"), files) == "Qwen3-8B-Q4_K_M.gguf"  # llama.cpp's default
    assert pick_gguf(HubName("q/r"), ["only-Q6_K.gguf", "mmproj-F16.gguf"]) == "only-Q6_K.gguf"
    assert pick_gguf(HubName("q/r"), ["config.json", "model.safetensors"]) is None  # a model directory
    with pytest.raises(ModelNameError, match="no GGUF file of Q2_K .* it has Qwen3-8B-Q4_K.gguf"):
        pick_gguf(HubName("q/r", "Q2_K"), files)
    with pytest.raises(ModelNameError, match="name one quantization"):
        pick_gguf(HubName("q/r"), ["a-Q8_0.gguf", "a-Q6_K.gguf"])
    with pytest.raises(ModelNameError, match="split over 2 GGUF files"):
        pick_gguf(HubName("q/r", "Q8_0"), ["Q8_0/a-Q8_0-00001-of-00002.gguf", "Q8_0/a-Q8_0-00002-of-00002.gguf"])


def test_a_name_downloads_into_the_cache_and_loads(tmp_path: Path) -> None:
    import ember

    with HubServer({GGUF_REPO: gguf_repo()}) as server:
        hub = hub_for(server, tmp_path)
        path = fetch(HubName(GGUF_REPO, "Q8_0"), hub)
        assert path.read_bytes() == DEMO_BYTES and str(tmp_path / "hub") in str(path)
        assert not any("Q4_K_M" in p or "README" in p for _, p, _ in server.requests)  # the one file only
        model = ember.load(f"{GGUF_REPO}:Q8_0", env=hub_env(server, tmp_path))
        ids = model.tokenize("def f(x):")
        assert model.logits(ids).tobytes() == ember.load(DEMO_MODEL).logits(ids).tobytes()
        assert resolve_model(str(DEMO_MODEL), hub) == DEMO_MODEL  # a path is a path
        server.requests.clear()
        assert fetch(HubName(GGUF_REPO, "Q8_0"), hub) == path
        assert not any(method == "GET" and "/resolve/" in p for method, p, _ in server.requests)  # not again


def test_offline_and_unreachable_hubs_serve_from_the_cache(tmp_path: Path) -> None:
    with HubServer({GGUF_REPO: gguf_repo()}) as server:
        cached = fetch(HubName(GGUF_REPO, "Q8_0"), hub_for(server, tmp_path))
        server.requests.clear()
        assert fetch(HubName(GGUF_REPO, "Q8_0"), hub_for(server, tmp_path, offline=True)) == cached
        assert server.requests == []  # offline asks nothing
        url = server.url
    gone = Hub(url, tmp_path / "hub")  # nothing listens there any more
    assert fetch(HubName(GGUF_REPO, "Q8_0"), gone) == cached
    with pytest.raises(ModelNameError, match=r"cannot reach .* not in the cache") as err:
        fetch(HubName(GGUF_REPO, "Q4_K_M"), gone)
    assert "\n" not in str(err.value)
    with pytest.raises(ModelNameError, match="cannot reach .* not in the cache"):
        fetch(HubName("nobody/nothing"), gone)


def test_bad_names_fail_in_one_line(tmp_path: Path) -> None:
    with HubServer({GGUF_REPO: gguf_repo()}) as server:
        hub = hub_for(server, tmp_path)
        for name, reason in ((HubName("nobody/nothing"), "no such model on"),
                             (HubName(GGUF_REPO, "Q2_K"), "no GGUF file of Q2_K")):
            with pytest.raises(ModelNameError, match=reason) as err:
                fetch(name, hub)
            assert "\n" not in str(err.value)
        done = cli("pull", "nobody/nothing", env=hub_env(server, tmp_path))
        assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith("ember: error: nobody/nothing: no such local path, and no such model on")


def test_a_model_directory_comes_with_its_config_tokenizer_and_safetensors_only(tmp_path: Path, hf_model) -> None:  # type: ignore[no-untyped-def]
    import ember

    folder, _ = hf_model("qwen3")
    (folder / "pytorch_model.bin").write_bytes(b"pickled weights ember never reads")
    names = sorted(p.name for p in folder.iterdir())
    with HubServer({}) as server:
        server.add_files("ember/tiny-qwen3", folder, names)
        local = fetch(HubName("ember/tiny-qwen3"), hub_for(server, tmp_path))
        assert sorted(p.name for p in local.iterdir()) == [n for n in names if n != "pytorch_model.bin"]
        ids = [1, 2, 3]
        assert ember.load(local).logits(ids).tobytes() == ember.load(folder).logits(ids).tobytes()
        with pytest.raises(ModelNameError, match="no GGUF files"):
            fetch(HubName("ember/tiny-qwen3", "Q8_0"), hub_for(server, tmp_path))


def test_download_lines_say_each_tenth_once() -> None:
    lines: list[str] = []
    show = DownloadLines(lines.append)
    for done in range(0, 1001, 50):
        show("m.gguf", done, 1000)
    show("m.gguf", 1000, 1000)
    assert lines[0] == "downloading m.gguf: 0.0 MB of 0.0 MB (0%)" and len(lines) == 11
    assert lines[-1].endswith("(100%)")


def test_a_cut_download_resumes_where_it_stopped_and_list_names_it(tmp_path: Path) -> None:
    """`ember pull` killed mid-file (a stalled transfer) leaves a partial file in the cache; the next
    pull asks the hub for the rest only (a Range request) and ends with the whole file. Under a
    pipe, the progress is lines on stderr."""
    cut = 11_000_000  # huggingface_hub writes what it got in 10 MiB chunks: the first is in the file
    with HubServer({GGUF_REPO: gguf_repo()}, stall_after=cut) as server:
        env = hub_env(server, tmp_path)
        first = subprocess.Popen([sys.executable, "-m", "ember.client.cli", "pull", f"{GGUF_REPO}:Q8_0"], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        partial: list[Path] = []
        while time.monotonic() < deadline:
            partial = [p for p in (tmp_path / "hub").rglob("*.incomplete") if p.stat().st_size >= 10 << 20]
            if partial:
                break
            time.sleep(0.1)
        first.kill()
        first.wait()
        assert partial, "the first pull never wrote its first bytes"
        kept = partial[0].stat().st_size
        server.release()
        done = cli("pull", f"{GGUF_REPO}:Q8_0", env=env)
        assert done.returncode == 0, done.stderr
        path = Path(done.stdout.strip())
        assert path.read_bytes() == DEMO_BYTES
        gets = [rng for method, p, rng in server.requests if method == "GET" and p.endswith("Q8_0.gguf")]
        assert gets == [None, f"bytes={kept}-"], gets
        lines = done.stderr.splitlines()
        assert lines and all(line.startswith("ember: downloading ember-demo-Q8_0.gguf: ") for line in lines), lines
        assert lines[-1].endswith("of 12.0 MB (100%)") and len(lines) <= 12
        listed = cli("list", env=env)
        assert listed.returncode == 0 and f"{GGUF_REPO}:Q8_0" in listed.stdout and str(path) in listed.stdout


@pytest.mark.slow
def test_the_daemon_serves_a_model_by_name_under_that_name(tmp_path: Path) -> None:
    """`ember serve --model owner/repo:QUANT`: fetched before the plan (a log line and a systemd status
    line per tenth, not a terminal's bar), served under the name it was given."""
    sys.path.insert(0, str(Path(__file__).parent / "daemon"))
    from daemon_process import DaemonProcess

    from ember.client import Client

    from daemon_process import wait_until

    name = f"{GGUF_REPO}:Q8_0"
    with HubServer({GGUF_REPO: gguf_repo()}, stall_after=11_000_000) as server:
        daemon = DaemonProcess(env={"HF_ENDPOINT": server.url, "HF_HUB_CACHE": str(tmp_path / "hub")},
                               args=("--model", name))
        try:
            # while it downloads, `ember status` says so (exit 3: starting), from the socket's lock file
            status = ["status", "--socket", str(daemon.socket)]
            assert wait_until(lambda: "downloading" in cli(*status, env=dict(os.environ)).stdout, 60, every=0.5)
            starting = cli(*status, env=dict(os.environ))
            assert starting.returncode == 3, starting
            assert starting.stdout.startswith(f"ember daemon (pid {daemon.proc.pid}) at {daemon.socket}: starting: "
                                              "downloading ember-demo-Q8_0.gguf: "), starting.stdout
            server.release()
            daemon.wait_ready(timeout=300)
            assert cli(*status, env=dict(os.environ)).returncode == 0
            with Client(daemon.socket) as client:
                assert [m.name for m in client.models()] == [name]
                tokens = [t for c in client.generate("def f(x):", model=name, max_tokens=4) for t in c.token_ids]
            assert len(tokens) == 4
            events = [e["event"] for e in daemon.log_events()]
            assert "model by name" in events
            assert any(e.startswith("downloading ember-demo-Q8_0.gguf: ") and e.endswith("(100%)") for e in events)
            assert any("STATUS=downloading ember-demo-Q8_0.gguf" in m for m in daemon.notify.messages)
        finally:
            daemon.stop()
