"""The gateway as a process: `ember gateway` and `ember serve --http` (one line and exit 1 for a refused
exposure, a clean SIGTERM), that it never imports the kernels, its systemd unit, and the serve child's
life: it serves beside the daemon, ends its streams with an error when the daemon cancels them, and stops
when the daemon exits."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from daemon_process import DaemonProcess
from gateway_setup import MODEL

pytestmark = pytest.mark.slow

SYSTEMD = Path(__file__).parents[2] / "systemd"
ENV = {k: v for k, v in os.environ.items() if k != "EMBER_API_KEY"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ember(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ember.client.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or ENV, check=False)


def get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code


def wait_listening(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on {port}"
            time.sleep(0.05)


def test_the_gateway_never_imports_the_kernels() -> None:
    code = ("import sys; import ember.client.gateway.server, ember.client.gateway.app, ember.client.cli.gateway_command;"
            "from ember.client.cli.main import build_parser; build_parser();"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'cupy', 'llvmlite', 'torch') "
            "or m.startswith(('ember.kernels', 'ember.daemon.runner', 'ember.daemon.engine', 'ember.daemon.models'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=ENV, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_exposure_without_a_key_is_refused_in_one_line(tmp_path: Path) -> None:
    for args in (("gateway", "--listen", "0.0.0.0:0"), ("serve", "--http", "0.0.0.0:0", "--socket", str(tmp_path / "s"))):
        t0 = time.monotonic()
        done = ember(*args)
        assert done.returncode == 1 and time.monotonic() - t0 < 20  # before any model is loaded
        assert done.stderr.strip().count("\n") == 0, done.stderr
        assert done.stderr.startswith("ember: error: refusing to listen on 0.0.0.0:0 without an API key")
    assert ember("gateway", "--listen", "nowhere").stderr.startswith("ember: error: --listen wants HOST:PORT")


def test_a_port_in_use_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for args, says in ((("gateway", "--listen", f"127.0.0.1:{port}"), "cannot listen on"),
                           (("serve", "--http", f"127.0.0.1:{port}", "--socket", str(tmp_path / "s")), "cannot listen there")):
            done = ember(*args)
            assert done.returncode == 1 and done.stderr.strip().count("\n") == 0, done.stderr
            assert says in done.stderr and "address already in use" in done.stderr.lower()


def test_gateway_command_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ember.client.cli", "gateway", "--listen", f"0.0.0.0:{port}",
                             "--socket", str(tmp_path / "no.sock")], env={**ENV, "EMBER_API_KEY": "k"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_listening(port)
        assert get(f"http://127.0.0.1:{port}/health") == 503  # up, and says the daemon is not
        assert get(f"http://127.0.0.1:{port}/v1/models") == 401  # the key from EMBER_API_KEY
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "gateway listening" in out and "gateway exit" in out


def test_serve_http_runs_the_gateway_as_the_daemons_child() -> None:
    port = free_port()
    daemon = DaemonProcess("[server]\ndrain_timeout = 0.5\n", args=("--http", f"127.0.0.1:{port}")).wait_ready(300)
    try:
        wait_listening(port)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0) as client:
            r = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=5, temperature=0)
            assert r.usage is not None and r.usage.completion_tokens == 5
            stream = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=4000, stream=True,
                                               extra_body={"ignore_eos": True})
            next(iter(stream))
            daemon.proc.send_signal(signal.SIGTERM)  # drains 0.5 s, then cancels what still runs
            with pytest.raises(openai.APIError, match="the ember daemon cancelled the request"):
                for _ in stream:
                    pass
    finally:
        rc = daemon.stop()
    assert rc == 0, daemon.log_path.read_text()
    with pytest.raises(OSError):  # the child went with the daemon
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    assert any(e.get("event") == "gateway exit" for e in daemon.log_events())


def test_serve_http_child_goes_with_a_killed_daemon() -> None:
    port = free_port()
    daemon = DaemonProcess("", args=("--http", f"127.0.0.1:{port}")).wait_ready(300)
    try:
        wait_listening(port)
        daemon.proc.kill()  # SIGKILL: no finally runs in the daemon; PR_SET_PDEATHSIG stops the child
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                break
            assert time.monotonic() < deadline, "the gateway outlived its daemon"
            time.sleep(0.05)
    finally:
        daemon.stop()


def test_systemd_unit() -> None:
    unit = (SYSTEMD / "ember-gateway.service").read_text()
    assert "ExecStart=/usr/local/bin/ember gateway --listen 127.0.0.1:8000 --socket /run/ember/ember.sock" in unit
    assert "After=ember.service" in unit and "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6" in unit
    assert "EnvironmentFile=-/etc/ember/gateway.env" in unit and "MemoryDenyWriteExecute=yes" in unit
    analyze, ember_bin = shutil.which("systemd-analyze"), shutil.which("ember")
    if analyze is None or ember_bin is None:
        pytest.skip("systemd-analyze or the ember console script is missing")
    copy = Path(os.environ.get("TMPDIR", "/tmp")) / f"ember-gateway-{os.getpid()}.service"
    copy.write_text(unit.replace("/usr/local/bin/ember", ember_bin))  # verify wants ExecStart's program to exist
    try:
        done = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60, check=False)
    finally:
        copy.unlink()
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
