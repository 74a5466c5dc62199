"""Configuration: TOML < EMBER_* < flags, and errors that name the key, the reason and the source."""
from __future__ import annotations

from pathlib import Path

import pytest

from ember.daemon.config import ConfigError, load_config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ember.toml"
    path.write_text(text)
    return path


def test_defaults_without_any_source(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, ""), env={})
    assert config.models == () and config.engine.device == "cpu" and config.server.socket == ""


def test_precedence_file_then_environment_then_flags(tmp_path: Path) -> None:
    path = write(tmp_path, """
[[models]]
path = "/m/a.gguf"
[server]
drain_timeout = 3
socket = "/from/file.sock"
[engine]
max_active = 2
max_queued = 7
""")
    env = {"EMBER_ENGINE_MAX_ACTIVE": "5", "EMBER_SOCKET": "/from/env.sock", "EMBER_MODELS": "/m/b.gguf:/m/c.gguf"}
    config = load_config(path, env=env, flags={"server.socket": "/from/flag.sock", "models": None})
    assert config.server.socket == "/from/flag.sock"
    assert config.server.drain_timeout == 3.0  # the file's, untouched by others
    assert (config.engine.max_active, config.engine.max_queued) == (5, 7)
    assert [m.path for m in config.models] == ["/m/b.gguf", "/m/c.gguf"]
    assert [m.display_name for m in config.models] == ["b", "c"]
    assert load_config(path, env={}, flags={"models": ["/x/y.gguf"]}).models[0].path == "/x/y.gguf"


def test_cuda_kernels_from_the_file_the_environment_or_the_serve_flag(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, ""), env={}).engine.cuda_kernels == "numba"
    path = write(tmp_path, "[engine]\ncuda_kernels = \"native\"\n")
    assert load_config(path, env={}).engine.cuda_kernels == "native"
    assert load_config(path, env={"EMBER_ENGINE_CUDA_KERNELS": "numba"}).engine.cuda_kernels == "numba"
    assert load_config(path, env={}, flags={"engine.cuda_kernels": "numba"}).engine.cuda_kernels == "numba"


def test_config_file_from_environment(tmp_path: Path) -> None:
    path = write(tmp_path, "[engine]\nmax_queued = 9\n")
    assert load_config(env={"EMBER_CONFIG": str(path)}).engine.max_queued == 9


@pytest.mark.parametrize("toml, env, expected", [
    ("[engine]\nmax_active = 0\n", {}, r"engine\.max_active: max_active must be >= 1, got 0 \(set by config file"),
    ("", {"EMBER_ENGINE_MAX_ACTIVE": "many"}, r"engine\.max_active: Expected `int`, got `str` \(set by the environment\)"),
    ("[engine]\nmax_activ = 2\n", {}, r"engine: Object contains unknown field `max_activ`"),
    ("[server]\nlog_format = \"xml\"\n", {}, r"log_format must be one of auto, json, console"),
    ("[engine]\ndevice = \"tpu\"\n", {}, r"device must be cpu or cuda:N"),
    ("[engine]\ncuda_kernels = \"fast\"\n", {}, r"engine\.cuda_kernels: cuda_kernels must be one of numba, native"),
    ("[engine]\nprompt_act = \"q4\"\n", {}, r"engine\.prompt_act: prompt_act 'q4' refused: unknown prompt activation precision 'q4'"),
    ("[engine]\ndecode_act = \"f32\"\nprompt_act = \"q8_0\"\n", {}, r"engine\.prompt_act: prompt_act 'q8_0' refused: .*use prompt_act f32 with it"),
    ("[[models]]\npath = 3\n", {}, r"models\.path: Expected `str`, got `int`"),
    ("[limits]\nmax_tokens = -1\n", {}, r"limits\.max_tokens"),
    ("[[models]]\npath = \"/a/x.gguf\"\n[[models]]\npath = \"/b/x.gguf\"\n", {}, r"two models are named x"),
    ("[engine\n", {}, r"is not valid TOML"),
])
def test_errors_say_what_why_and_where(tmp_path: Path, toml: str, env: dict[str, str], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config(write(tmp_path, toml), env=env)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.toml", env={})


def test_kv_dtype_follows_the_precision_policy_order(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, ""), env={}).engine.kv_dtype == ""  # the policy's default (f32)
    path = write(tmp_path, '[engine]\nkv_dtype = "bf16"\n')
    assert load_config(path, env={}).engine.kv_dtype == "bf16"
    assert load_config(path, env={"EMBER_KV_DTYPE": "f16"}).engine.kv_dtype == "f16"
    assert load_config(path, env={"EMBER_KV_DTYPE": "f16"}, flags={"engine.kv_dtype": "q8_0"}).engine.kv_dtype == "q8_0"
    with pytest.raises(ConfigError, match=r"engine\.kv_dtype: kv_dtype must be one of .* \(set by the environment\)"):
        load_config(path, env={"EMBER_KV_DTYPE": "f8"})
