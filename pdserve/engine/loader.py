"""Build a model from a Hugging Face directory (config.json + *.safetensors)."""

from __future__ import annotations

from pathlib import Path

import structlog
import torch
from safetensors import safe_open

from pdserve.engine.config import ModelConfig
from pdserve.engine.linear import QUANT_FORMATS, attach_gguf_blocks
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.errors import ModelLoadError

log = structlog.get_logger(__name__)


def load_model(model_dir: Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
               weight_format: str | None = None) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Load and pack (see LlamaForCausalLM.pack). ``dtype`` is the activation and KV dtype;
    ``weight_format`` (default: the same as ``dtype``) how the projections are stored, e.g.
    "int8" with float32 activations."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                if name not in params:
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    raise ModelLoadError(f"unexpected weight {name!r} in {f.name}")
                tensors[name] = st.get_tensor(name).to(dtype)
                loaded.add(name)
    if config.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelLoadError(f"weights missing from {model_dir}: {', '.join(missing[:5])}")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(params[name].shape):
            raise ModelLoadError(
                f"weight {name} has shape {tuple(t.shape)}, expected {tuple(params[name].shape)}")
    # The meta model was built in the default dtype (float32); copy_ would cast back into it.
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in tensors:
                p.copy_(tensors[name])
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        # Buffers were on the meta device: recompute them for real.
        from pdserve.engine.models.llama import _inv_freq

        model.model.rotary_emb.inv_freq = _inv_freq(
            config.head_dim, config.rope_theta, config.rope_scaling).to(device)
    model.eval()
    if weight_format in QUANT_FORMATS:
        _attach_gguf(model, model_dir, config)
    model.pack(weight_format or str(dtype).removeprefix("torch."))
    return model, config


def _attach_gguf(model: LlamaForCausalLM, model_dir: Path, config: ModelConfig) -> None:
    """Hand the GGUF's own blocks to `pack` for every weight stored quantized there (the float
    weights just loaded are their dequantization); a model without a GGUF is quantized at load."""
    from pdserve.engine import model_store

    try:
        path = model_store.model_gguf(model_dir)
    except ModelLoadError as exc:
        log.warning("gguf_not_found", model_dir=str(model_dir), error=str(exc),
                    fallback="weights quantized at load from the float checkpoint")
        return
    params = dict(model.named_parameters())
    found = model_store.gguf_blocks(path, config.num_heads, config.num_kv_heads)
    for name, (qtype, blocks) in found.items():
        if name in params:
            attach_gguf_blocks(params[name], qtype, blocks)
    log.info("gguf_blocks_attached", gguf=str(path), tensors=len(found))
