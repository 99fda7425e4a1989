"""The foundation: fixtures, settings precedence, model fixtures, BLAS preload."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from batchd.config.settings import SettingsError, load_settings
from batchd.engine.blas import SKYLAKEX_FLAGS, cpu_flags, cpu_model, kernel_choice
from support.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[1]


def test_private_redis_is_not_the_default_port(redis_server: RedisServer) -> None:
    assert redis_server.port != 6379
    client = redis_server.client()
    client.set("k", "v")
    assert client.get("k") == b"v"
    assert client.config_get("appendonly")["appendonly"] == "no"


def test_aof_redis_keeps_data_across_kill(redis_server_aof: RedisServer) -> None:
    client = redis_server_aof.client()
    client.xadd("s", {"f": "1"})
    assert client.config_get("appendonly")["appendonly"] == "yes"
    redis_server_aof.kill()
    redis_server_aof.start()
    assert redis_server_aof.client().xlen("s") == 1


def test_fake_redis_is_isolated(fake_redis: redis.Redis) -> None:
    assert fake_redis.dbsize() == 0
    fake_redis.xadd("q", {"job": "{}"})
    assert fake_redis.xlen("q") == 1


def test_settings_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "batchd.toml"
    cfg.write_text('key_prefix = "fromfile"\n[engine]\nmax_num_seqs = 7\nblock_size = 32\n')
    monkeypatch.setenv("BATCHD_ENGINE__MAX_NUM_SEQS", "9")
    settings = load_settings(cfg)
    assert settings.engine.max_num_seqs == 9  # env beats file
    assert settings.engine.block_size == 32  # file beats default
    assert settings.key_prefix == "fromfile"
    assert settings.engine.max_num_batched_tokens == 512  # default
    monkeypatch.setenv("BATCHD_CONFIG", str(cfg))
    assert load_settings(redis_url="redis://h:1/0").redis_url == "redis://h:1/0"
    assert load_settings().key_prefix == "fromfile"


def test_invalid_setting_names_option_and_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHD_ENGINE__MAX_NUM_SEQS", "abc")
    with pytest.raises(SettingsError) as err:
        load_settings()
    assert "engine.max_num_seqs" in str(err.value)
    assert "BATCHD_ENGINE__MAX_NUM_SEQS" in str(err.value)
    assert "'abc'" in str(err.value)


def test_cli_rejects_bad_setting() -> None:
    env = {**os.environ, "BATCHD_ENGINE__MAX_NUM_SEQS": "abc"}
    proc = subprocess.run(
        [sys.executable, "-m", "batchd.daemon.cli", "make-model", "/nonexistent/x"],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "engine.max_num_seqs" in proc.stderr and "abc" in proc.stderr


def _digest(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


def test_make_model_is_deterministic_and_loads(tiny_model: Path, tmp_path: Path) -> None:
    import mlx_lm

    from batchd.engine.models.model_fixture import FixtureSpec, make_model

    again = make_model(tmp_path / "again", FixtureSpec(preset="tiny"))
    assert _digest(again) == _digest(tiny_model)
    other = make_model(tmp_path / "other", FixtureSpec(preset="tiny", seed=1))
    assert _digest(other)["model.safetensors"] != _digest(tiny_model)["model.safetensors"]
    model, tokenizer = mlx_lm.load(str(tiny_model))
    text = mlx_lm.generate(model, tokenizer, "hello", max_tokens=5)
    assert isinstance(text, str) and text
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token_ids
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("arch", ["qwen3"])
def test_make_model_other_arch_and_quantized(tmp_path: Path, arch: str) -> None:
    import mlx_lm

    from batchd.engine.models.model_fixture import FixtureSpec, make_model

    q3 = make_model(tmp_path / arch, FixtureSpec(arch=arch))
    model, tokenizer = mlx_lm.load(str(q3))
    assert model.model_type == arch
    q4 = make_model(tmp_path / "q4", FixtureSpec(quantize_bits=4))
    model, tokenizer = mlx_lm.load(str(q4))
    assert "quantization" in (q4 / "config.json").read_text()
    assert mlx_lm.generate(model, tokenizer, "hello", max_tokens=3)


_MATMUL_RATE = """
import time
import batchd.engine.preload
import mlx.core as mx
from batchd.engine.blas import loaded_openblas
a = mx.random.normal((512, 512)); mx.eval(a)
mx.eval(a @ a)
t = time.perf_counter()
for _ in range(8):
    mx.eval(a @ a)
print(loaded_openblas(), 8 * 2 * 512**3 / (time.perf_counter() - t) / 1e9)
"""


def _python_prints(code: str, env: dict[str, str]) -> list[str]:
    """What ``code`` prints, split into words, run by this Python in a fresh process."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=True,
    ).stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS preload is Linux-only")
def test_openblas_preload_takes_effect() -> None:
    def run(disable: bool) -> tuple[str, float]:
        out = _python_prints(
            _MATMUL_RATE, {**os.environ, "BATCHD_NO_OPENBLAS": "1" if disable else "0"}
        )
        return out[0], float(out[1])

    lib, fast = run(disable=False)
    assert "openblas" in lib
    none, slow = run(disable=True)
    assert none == "None"
    assert fast > 5 * slow, (fast, slow)


def test_kernel_choice_asks_for_avx512_kernels_only_where_the_cpu_has_them() -> None:
    avx512 = SKYLAKEX_FLAGS | {"fma", "avx2"}
    assert kernel_choice(avx512) == "SkylakeX"
    assert kernel_choice(avx512, ("GenuineIntel", 6)) == "SkylakeX"
    assert kernel_choice(avx512, ("AuthenticAMD", 26)) == "SkylakeX"  # Zen 5: full-width units
    assert kernel_choice(frozenset({"fma", "avx2", "avx512f"})) is None
    assert kernel_choice(frozenset({"fma", "avx2"}), ("AuthenticAMD", 25)) is None  # Zen 3
    assert kernel_choice(frozenset()) is None


def test_kernel_choice_takes_avx2_kernels_on_zen4s_half_width_avx512() -> None:
    assert kernel_choice(SKYLAKEX_FLAGS | {"fma", "avx2"}, ("AuthenticAMD", 25)) == "Haswell"


@pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.machine() == "x86_64"),
    reason="/proc/cpuinfo names a vendor and family on x86-64 Linux only",
)
def test_cpu_model_reads_this_machines_vendor_and_family() -> None:
    vendor, family = cpu_model()
    assert vendor in {"GenuineIntel", "AuthenticAMD"}, vendor
    assert family > 0


_CORE = """
import os
import batchd.engine.preload
from batchd.engine.blas import loaded_core
print(loaded_core(), os.environ.get("OPENBLAS_CORETYPE"))
"""


_TIMEOUT = """
import os
import batchd.engine.preload
from batchd.engine.blas import loaded_openblas
print(loaded_openblas() is not None, os.environ.get("OPENBLAS_THREAD_TIMEOUT"))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS is preloaded on Linux")
def test_openblas_workers_sleep_between_products_unless_the_user_says_otherwise() -> None:
    """Set before the library loads (it reads the variable once): idle workers sleep at once."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    assert _python_prints(_TIMEOUT, env) == ["True", "4"]
    assert _python_prints(_TIMEOUT, {**env, "OPENBLAS_THREAD_TIMEOUT": "20"}) == ["True", "20"]


@pytest.mark.skipif(
    not SKYLAKEX_FLAGS <= cpu_flags(), reason="the CPU lacks the AVX-512 subsets SkylakeX needs"
)
def test_openblas_runs_the_chosen_kernels_where_the_cpu_has_avx512() -> None:
    """A CPU newer than the OpenBLAS build made it fall back to SSE3 kernels (5x slower)."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    expected = kernel_choice(cpu_flags(), cpu_model())
    assert expected in {"SkylakeX", "Haswell"}
    assert _python_prints(_CORE, env) == [expected, expected]
    other = "SkylakeX" if expected == "Haswell" else "Haswell"
    chosen = {**env, "OPENBLAS_CORETYPE": other}
    assert _python_prints(_CORE, chosen) == [other, other]  # the user's choice stands
