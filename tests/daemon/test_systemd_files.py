"""systemd/: the unit passes `systemd-analyze verify`, carries the notify/watchdog/hardening settings
the daemon relies on, and the sysusers, tmpfiles and example configuration files do what they say."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ember.daemon.config import load_config

SYSTEMD = Path(__file__).parents[2] / "systemd"


def directives(unit: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in unit.read_text().splitlines():
        if re.match(r"^\w+=", line):
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed")
    return path


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    ember = shutil.which("ember")
    assert ember, "the ember console script is not on PATH"
    unit = tmp_path / "ember.service"  # verify checks that ExecStart's program exists: point it at ours
    unit.write_text((SYSTEMD / "ember.service").read_text().replace("/usr/local/bin/ember", ember))
    done = subprocess.run([tool("systemd-analyze"), "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


def test_unit_settings_the_daemon_relies_on() -> None:
    d = directives(SYSTEMD / "ember.service")
    assert d["Type"] == ["notify"] and d["NotifyAccess"] == ["main"]
    assert d["ExecStart"][0].split()[1:3] == ["serve", "--config"]
    assert d["RuntimeDirectory"] == ["ember"]  # the daemon binds $RUNTIME_DIRECTORY/ember.sock
    assert d["RuntimeDirectoryMode"] == ["0750"] and d["User"] == ["ember"]
    assert d["WatchdogSec"] and d["KillSignal"] == ["SIGTERM"]
    assert d["NoNewPrivileges"] == ["yes"] and d["ProtectSystem"] == ["strict"] and d["PrivateTmp"] == ["yes"]
    assert any("nvidia" in v for v in d["DeviceAllow"]) and d["DevicePolicy"] == ["closed"]
    assert "MemoryDenyWriteExecute" not in d  # numba writes executable code at run time
    assert d["Environment"] == ["NUMBA_CACHE_DIR=/var/cache/ember/numba"] and d["CacheDirectory"] == ["ember"]


def test_sysusers_and_tmpfiles_create_the_user_and_directories(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    subprocess.run([tool("systemd-sysusers"), f"--root={tmp_path}", str(SYSTEMD / "ember.sysusers")],
                   check=True, capture_output=True, timeout=60)
    user = next(line for line in (tmp_path / "etc/passwd").read_text().splitlines() if line.startswith("ember:"))
    uid = int(user.split(":")[2])
    subprocess.run([tool("systemd-tmpfiles"), f"--root={tmp_path}", "--create", str(SYSTEMD / "ember.tmpfiles")],
                   check=True, capture_output=True, timeout=60)
    models = tmp_path / "var/lib/ember/models"
    assert models.is_dir() and models.stat().st_uid == uid and (models.stat().st_mode & 0o777) == 0o755


def test_example_configuration_is_valid() -> None:
    config = load_config(SYSTEMD / "ember.toml", env={})
    assert config.server.socket_group == "ember" and config.models[0].display_name == "qwen3-8b"
