"""Engine and model configuration: frozen dataclasses validated on construction."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.errors import InvalidRequestError, ModelLoadError, UnsupportedArchitectureError

# Architectures the model code implements. Each is a Llama-style decoder; the differences are
# captured by ModelConfig flags (qkv bias, QK-norm, RoPE scaling, tied embeddings).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is "default" or "llama3"."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projections have a bias
    o_proj_bias: bool = False  # Llama and Qwen3 put attention_bias on o_proj too, Qwen2 not
    mlp_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type", "")
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
            if not archs and model_type in by_type:
                arch = by_type[model_type]
            else:
                name = ", ".join(archs) or model_type or "<none given>"
                supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
                raise UnsupportedArchitectureError(
                    f"unsupported model architecture {name}; pdserve supports: {supported}"
                )
        kind = SUPPORTED_ARCHITECTURES[arch]
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type not in ("default", "llama3"):
            raise UnsupportedArchitectureError(f"unsupported RoPE scaling type {rope_type!r}")
        scaling = RopeScaling()
        if rope_type == "llama3":
            scaling = RopeScaling(
                kind="llama3",
                factor=float(rope["factor"]),
                low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(
                    rope.get("original_max_position_embeddings", 8192)
                ),
            )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has a q/k/v bias; Llama/Mistral/Qwen3 only if configured.
            attention_bias=kind == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_proj_bias=kind in ("llama", "qwen3") and bool(cfg.get("attention_bias", False)),
            mlp_bias=kind == "llama" and bool(cfg.get("mlp_bias", False)),
            qk_norm=kind == "qwen3",
            rope_scaling=scaling,
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            return cls.from_hf(json.loads(path.read_text()))
        except FileNotFoundError as exc:
            raise ModelLoadError(f"no config.json in model directory {model_dir}") from exc
        except (KeyError, ValueError, TypeError) as exc:
            raise ModelLoadError(f"invalid config.json in {model_dir}: {exc}") from exc


DTYPES = ("float32", "bfloat16", "float16", "int8", "q4_0", "q4_1", "q8_0")


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs. KV memory is `kv_cache_bytes` unless `num_kv_blocks` pins the count."""

    block_size: int = 16
    # `--kv-cache-mb`'s default (2048) on every command: 64 sequences (`max_num_seqs`) of ~700
    # tokens for the default model in float32. At 512 MiB a 2-core CPU's c=64 load of 264-token
    # streams preempted and recomputed (docs/BENCHMARKS.md, "A KV pool that holds
    # max_num_seqs streams"). Checked against the memory available when the pool is made.
    kv_cache_bytes: int = 2048 << 20
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget (decodes + prefill chunks)
    max_prefill_chunk: int = 512  # longest prefill piece of one sequence in one step
    # A step's time the scheduler aims for: prompt tokens per step = the engine's measured
    # prefill rate x this (at least MIN_STEP_PREFILL_TOKENS, within max_num_batched_tokens),
    # so a slow device takes small steps and a fast one its whole budget. 0: the token budget
    # alone. 750 ms measured best on a 2-core CPU (c=16 TTFT p50 0.47x, longest stall 0.6x, same
    # throughput; docs/BENCHMARKS.md, "A step budget set in time"). See
    # pdserve.engine.scheduler.
    step_target_ms: float = 750.0
    # The same for a step that computes an interactive prompt: the prompt tokens of worse
    # classes after it are cut so that the step's prompt tokens stay within the measured
    # prefill rate x this. An interactive prompt that joins a running batch prompt's chunks
    # then waits for its own short step, not for a 750 ms one it shares with a 512-token
    # chunk. 0: such a step takes `step_target_ms`'s budget. See pdserve.engine.scheduler.
    interactive_step_target_ms: float = 250.0
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # How weights are stored and multiplied (engine.linear): float32 (exact), bfloat16 /
    # float16 (activations and KV in that dtype too), int8 or GGUF blocks q4_0/q4_1/q8_0 (float32
    # activations and KV; the blocks are read from the model's GGUF where it has one).
    dtype: str = "float32"
    device: str = "cpu"
    num_threads: int | None = None  # torch intra-op threads; None keeps torch's default
    # Each step runs on as many of those threads as this process's CPUs other processes leave
    # free (at least one; pdserve.engine.free_cpus): for a worker that shares its CPUs at a
    # lower priority (`pdserve cluster up`'s prefill workers), whose threads on a CPU a busy
    # neighbour takes would make every parallel region wait for them.
    adapt_threads: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidRequestError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise InvalidRequestError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise InvalidRequestError("max_num_batched_tokens must be >= max_num_seqs")
        if not 1 <= self.max_prefill_chunk <= self.max_num_batched_tokens:
            raise InvalidRequestError("max_prefill_chunk must be in [1, max_num_batched_tokens]")
        if self.step_target_ms < 0:
            raise InvalidRequestError("step_target_ms must be >= 0")
        if self.interactive_step_target_ms < 0:
            raise InvalidRequestError("interactive_step_target_ms must be >= 0")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise InvalidRequestError("num_kv_blocks must be >= 2")
        if self.dtype not in DTYPES:
            raise InvalidRequestError(
                f"unsupported dtype {self.dtype!r}; one of {', '.join(DTYPES)}")

    @property
    def activation_dtype(self) -> str:
        """dtype of activations and of the KV cache."""
        return self.dtype if self.dtype in ("float32", "bfloat16", "float16") else "float32"
