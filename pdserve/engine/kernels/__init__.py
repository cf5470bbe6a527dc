"""Elementwise and attention kernels of a decoder layer, as one small interface.

`TorchKernels` is the reference: plain ATen ops, any device and dtype. `FusedCpuKernels` runs
the same arithmetic as a handful of fused C++ loops (cpu_ops.cpp) for float32 on CPU, where a
decode step was otherwise dominated by launching ~35 tiny ops per layer, and reads paged K/V in
place instead of gathering it. The C++ is compiled once per machine at first use
(`torch.utils.cpp_extension`, ~1 min; cached under ~/.cache/torch_extensions/pdserve, or
$TORCH_EXTENSIONS_DIR, keyed by the source, the torch version and the CPU's flags, since it is
built with -march=native).
`kernels_for()` falls back to `TorchKernels` wherever the build is not possible. Builds are
serialized by an flock, so a build killed halfway never blocks later loads.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import structlog
import torch
import torch.nn.functional as F

log = structlog.get_logger(__name__)
_SOURCE = Path(__file__).with_name("cpu_ops.cpp")
DISABLE_ENV = "PDSERVE_DISABLE_CPU_KERNELS"
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]  # how cpu_ops.cpp is built


class TorchKernels:
    """Reference implementations (transformers' arithmetic), any device and dtype."""

    name = "torch"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)

    def add_rms_norm_(self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        """``residual += delta``; returns the RMS norm of the new residual."""
        residual.add_(delta)
        return self.rms_norm(residual, weight, eps)

    @staticmethod
    def rope_(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate-half RoPE in place on heads [0, heads) of x: [tokens, >=heads, head_dim]."""
        v = x[:, :heads]
        x1, x2 = v.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        v.copy_(v * cos[:, None, :] + rotated * sin[:, None, :])

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
        kv_layer[slot_blocks, 0, slot_offsets] = k
        kv_layer[slot_blocks, 1, slot_offsets] = v

    @staticmethod
    def decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor,
                         lens: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """One query per sequence over its paged context. q: [b, heads, d] -> [b, heads, d]."""
        k = gather_blocks(kv_layer, 0, tables).flatten(1, 2).transpose(1, 2)  # [b, h, T, d]
        v = gather_blocks(kv_layer, 1, tables).flatten(1, 2).transpose(1, 2)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        return o.squeeze(2)


class FusedCpuKernels(TorchKernels):
    """float32 CPU: the same contract through the compiled extension."""

    name = "fused-cpu"

    def __init__(self, ext: ModuleType, *, prefetch: bool = True):
        self._ext = ext
        self._prefetch = prefetch  # the decode attention's (attention_prefetch())

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                 eps: float) -> torch.Tensor:
        return self._ext.rms_norm(x, weight, eps)

    def add_rms_norm_(self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        return self._ext.add_rms_norm_(residual, delta, weight, eps)

    def rope_(self, x: torch.Tensor, heads: int,  # type: ignore[override]
              cos: torch.Tensor, sin: torch.Tensor) -> None:
        self._ext.rope_(x, heads, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self._ext.silu_mul(gate_up)

    def write_kv(self, kv_layer: torch.Tensor, k: torch.Tensor,  # type: ignore[override]
                 v: torch.Tensor, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
        self._ext.write_kv(kv_layer, k, v, slot_blocks, slot_offsets)

    def decode_attention(self, q: torch.Tensor, kv_layer: torch.Tensor,  # type: ignore[override]
                         tables: torch.Tensor, lens: torch.Tensor, mask: torch.Tensor,
                         scale: float) -> torch.Tensor:
        return self._ext.paged_decode_attention(
            q, kv_layer, tables, lens, scale, self._prefetch)

    def decode_stack(self, heads: int, kv_heads: int, head_dim: int, scale: float) -> Any:
        """An empty cpu_ops.cpp DecodeStack (add its layers, then `run` whole steps' layers
        in one call) with this object's attention settings."""
        return self._ext.DecodeStack(heads, kv_heads, head_dim, scale, self._prefetch)


def gather_blocks(kv_layer: torch.Tensor, kind: int, block_ids: torch.Tensor) -> torch.Tensor:
    """K (kind 0) or V (kind 1) of ``block_ids`` (any shape) as [*block_ids.shape, bs, h, d]:
    one index_select of whole blocks (several times faster on CPU than advanced indexing)."""
    rows = kv_layer[:, kind].index_select(0, block_ids.flatten())
    return rows.view(*block_ids.shape, *rows.shape[1:])


BUILD_WAIT_S = 600.0  # longest wait for another process's build of the same kernels


def _build_root() -> Path:
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "torch_extensions" / "pdserve"


@contextlib.contextmanager
def _exclusive(lock_path: Path, timeout_s: float) -> Iterator[None]:
    """An flock on ``lock_path``: the kernel released it if its holder died, unlike the
    lock file torch's builder leaves behind when a build is killed."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as fh:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another process held {lock_path} for {timeout_s:.0f} s") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build_dir() -> Path:
    """Where this source, torch and CPU's build lives (and what is measured of it)."""
    return _build_root() / f"pdserve_cpu_ops_{_build_key()}"


@functools.cache
def _build_key() -> str:
    from pdserve.engine.cpu import cpu_info

    info = cpu_info()
    # The paths are in the key too: ninja's build file names the source and torch's headers
    # by path, so two checkouts or venvs sharing one build directory would rebuild each
    # other's kernel on every load (seen: a CI clone beside a working tree).
    return hashlib.sha256(_SOURCE.read_bytes() + torch.__version__.encode()
                          + " ".join(sorted(info.flags)).encode()
                          + str(_SOURCE.resolve()).encode() + str(torch.__file__).encode()
                          ).hexdigest()[:16]


@functools.cache
def _build() -> ModuleType | None:
    from torch.utils import cpp_extension

    build_dir = _build_dir()
    name = build_dir.name
    log.info("cpu_kernels_loading", name=name,
             note="compiled once per machine (about a minute), then cached")
    try:
        with _exclusive(build_dir.with_suffix(".flock"), BUILD_WAIT_S):
            # We hold the only build lock, so a torch baton left in the build directory
            # belongs to a build that was killed: without this, every later load waits forever.
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("cpu_kernels_stale_lock_removed", path=str(stale))
                stale.unlink(missing_ok=True)
            build_dir.mkdir(parents=True, exist_ok=True)
            return cpp_extension.load(
                name=name, sources=[str(_SOURCE)], build_directory=str(build_dir),
                extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, unusual platform: stay correct
        log.warning("cpu_kernels_unavailable", error=str(exc)[:500],
                    fallback="torch ops (slower decode)")
        return None


def cpu_extension() -> ModuleType | None:
    """The compiled CPU ops, or None where they cannot be built (or are disabled)."""
    return None if os.environ.get(DISABLE_ENV) else _build()


PREFETCH_ENV = "PDSERVE_ATTENTION_PREFETCH"  # "1" / "0": skip the measurement


def measure_attention_prefetch(ext: ModuleType, *, layers: int = 30, batch: int = 16,
                               context: int = 240, rounds: int = 7) -> dict[str, float]:
    """The decode attention's time per call with its prefetch on and off, medians of
    ``rounds`` alternating rounds over ``layers`` layers of a pool larger than the caches,
    each sequence's 16-token blocks scattered through it as a running engine's are
    (SmolLM2-135M's heads: 9 query heads over 3 KV heads of 64)."""
    from pdserve.engine.model_runner import kv_pool_tensor

    g = torch.Generator().manual_seed(0)
    block, nb = 16, -(-context // 16)
    pool = kv_pool_tensor((batch * nb, layers, 2, block, 3, 64), torch.float32,
                          torch.device("cpu"))
    pool.uniform_(-1.0, 1.0, generator=g)
    tables = torch.randperm(batch * nb, generator=g).view(batch, nb)
    lens = torch.full((batch,), context)
    q = torch.randn(batch, 9, 64, generator=g)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for prefetch in (False, True):
            t = time.perf_counter()
            for i in range(layers):
                ext.paged_decode_attention(q, pool[:, i], tables, lens, 0.125, prefetch)
            times[prefetch].append((time.perf_counter() - t) / layers)
    return {"on_ms": 1e3 * sorted(times[True])[rounds // 2],
            "off_ms": 1e3 * sorted(times[False])[rounds // 2]}


@functools.cache
def attention_prefetch() -> bool:
    """Whether the decode attention should prefetch on this machine: measured once per
    machine and build (~1 s, under the build's lock so that workers starting together do
    not time each other) and kept beside the build; ``PDSERVE_ATTENTION_PREFETCH`` decides
    instead where set."""
    forced = os.environ.get(PREFETCH_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    ext = cpu_extension()
    if ext is None:
        return False
    path = _build_dir() / "attention_prefetch.json"
    try:
        with _exclusive(_build_dir().with_suffix(".flock"), BUILD_WAIT_S):
            try:
                return bool(json.loads(path.read_text())["prefetch"])
            except (OSError, ValueError, KeyError, TypeError):
                pass  # not measured yet here (or a torn file): measure
            with torch.inference_mode():
                times = measure_attention_prefetch(ext)
            choice = times["on_ms"] < times["off_ms"]
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"prefetch": choice, **times}) + "\n")
            tmp.replace(path)
            log.info("attention_prefetch_measured", prefetch=choice,
                     on_ms=round(times["on_ms"], 3), off_ms=round(times["off_ms"], 3))
            return choice
    except (OSError, TimeoutError) as exc:  # an unwritable cache: keep the kernel's default
        log.warning("attention_prefetch_unmeasured", error=str(exc)[:200])
        return True


def kernels_for(device: torch.device, dtype: torch.dtype) -> TorchKernels:
    """The fastest implementation for activations of ``dtype`` on ``device``."""
    if device.type == "cpu" and dtype == torch.float32:
        ext = cpu_extension()
        if ext is not None:
            return FusedCpuKernels(ext, prefetch=attention_prefetch())
    return TorchKernels()
