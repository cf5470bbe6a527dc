"""The only part of the engine that touches torch tensors of the model and the KV pool."""

from __future__ import annotations

import dataclasses
import math
import mmap
import os

import torch

from pdserve.engine.attention import HAVE_FLASH_ATTN, AttentionMetadata
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.errors import ModelLoadError
from pdserve.kv_layout import KVLayout

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def kv_layout(model: ModelConfig, config: EngineConfig, model_id: str) -> KVLayout:
    """The KV pool this engine config gives ``model``: ``config.num_kv_blocks`` blocks, or as
    many as fit in ``config.kv_cache_bytes``."""
    layout = KVLayout.for_budget(
        config.kv_cache_bytes, num_layers=model.num_layers, block_size=config.block_size,
        num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
        dtype=config.activation_dtype, model_id=model_id)
    if config.num_kv_blocks:
        return dataclasses.replace(layout, num_blocks=config.num_kv_blocks)
    return layout


def _cgroup_room() -> int | None:
    """What this process's memory cgroup's limit leaves (limit - usage); None without a
    limit. cgroup v2 ("0::/path") or v1 ("N:memory:/path"); inside a container's namespace
    the path is "/", or is not mounted and the mount's root is the container's group."""
    files = {"0": ("", "memory.max", "memory.current"),
             "memory": ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes")}
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.strip().split(":", 2) for line in f]
    except OSError:
        return None
    for hid, controllers, rel in (x for x in lines if len(x) == 3):
        key = "0" if hid == "0" else "memory" if "memory" in controllers.split(",") else ""
        if not key:
            continue
        sub, limit_file, usage_file = files[key]
        for group in (os.path.join("/sys/fs/cgroup", sub, rel.lstrip("/")),
                      os.path.join("/sys/fs/cgroup", sub)):
            try:
                with open(os.path.join(group, limit_file)) as f:
                    cap = f.read().strip()
                with open(os.path.join(group, usage_file)) as f:
                    used = int(f.read())
            except (OSError, ValueError):
                continue
            if cap != "max" and int(cap) < 1 << 60:  # v1 spells "no limit" as ~2**63
                return int(cap) - used
            break
    return None


def memory_available() -> int | None:
    """Bytes this process can still fault in: /proc/meminfo's MemAvailable, lowered to what
    its memory cgroup's limit leaves inside a container. None where neither can be read."""
    limits = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError):
        pass
    room = _cgroup_room()
    if room is not None:
        limits.append(room)
    return min(limits) if limits else None


# Memory the pool must leave to the rest of the process and the host (weights are loaded
# before the pool; activations, the RPC buffers and the page cache want the rest).
_POOL_HEADROOM = 256 << 20


def check_pool_fits(nbytes: int) -> None:
    """Refuse, with the flag to change, a host-memory KV pool that would not fit: the pool is
    faulted in up front, so one that did not fit would end in the OOM killer, not an error."""
    free = memory_available()
    if free is not None and nbytes + _POOL_HEADROOM > free:
        raise ModelLoadError(
            f"the KV cache pool ({nbytes >> 20} MiB) does not fit in the {max(free, 0) >> 20} MiB "
            f"of memory available ({_POOL_HEADROOM >> 20} MiB kept free): lower --kv-cache-mb "
            f"(EngineConfig.kv_cache_bytes)")


def kv_pool_tensor(shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """A zeroed pool. On a Linux CPU it lives in its own anonymous mapping marked for
    transparent huge pages (where the kernel's THP mode is "madvise", the common default): a
    decode step reads every sequence's blocks scattered through the pool, and with 4 KiB pages
    each block's rows cost TLB misses. Faulted in here, not during the first steps.
    ``PDSERVE_NO_KV_HUGEPAGES=1``: plain torch.zeros. A pool in host memory larger than the
    memory available is refused (`check_pool_fits`)."""
    if device.type == "cpu":
        check_pool_fits(math.prod(shape) * dtype.itemsize)
    if (device.type != "cpu" or not hasattr(mmap, "MADV_HUGEPAGE")
            or os.environ.get("PDSERVE_NO_KV_HUGEPAGES") == "1"):
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    # private and anonymous (shared memory has its own THP setting, usually off): zero-filled,
    # and kept alive by the tensor made over it
    region = mmap.mmap(-1, max(count * dtype.itemsize, 1),
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP unavailable: 4 KiB pages, as torch.zeros would give
        pass
    pool = torch.frombuffer(region, dtype=dtype, count=count).view(shape)
    pool.zero_()  # touch every page now
    return pool


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, model_config: ModelConfig, config: EngineConfig,
                 model_id: str):
        self.model = model
        self.model_config = model_config
        self.config = config
        self.device = torch.device(config.device)
        self.layout = kv_layout(model_config, config, model_id)
        # One contiguous allocation for the whole pool: kvxfer addresses it by byte range.
        self.kv_pool = kv_pool_tensor(self.layout.shape, _DTYPES[self.layout.dtype], self.device)
        self.use_flash = HAVE_FLASH_ATTN and self.device.type == "cuda"

    def _metadata(self, pieces: list[ScheduledSeq], decodes: list[ScheduledSeq]) -> tuple[
            AttentionMetadata, list[int], list[int]]:
        bs = self.config.block_size
        dev = self.device
        input_ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        for s in pieces + decodes:
            table = s.seq.block_table
            for p in range(s.start, s.start + s.num_new_tokens):
                slot_blocks.append(table[p // bs])
                slot_offsets.append(p % bs)
            input_ids.extend(s.seq.token_ids[s.start : s.start + s.num_new_tokens])
            positions.extend(range(s.start, s.start + s.num_new_tokens))
        dec_tables = dec_lens = dec_mask = None
        if decodes:
            lens = [s.start + 1 for s in decodes]
            max_blocks = -(-max(lens) // bs)
            rows = [s.seq.block_table[:max_blocks] + [0] * (max_blocks - len(
                s.seq.block_table[:max_blocks])) for s in decodes]
            dec_tables = torch.tensor(rows, dtype=torch.long, device=dev)
            dec_lens = torch.tensor(lens, dtype=torch.long, device=dev)
            span = torch.arange(max_blocks * bs, device=dev)
            dtype = _DTYPES[self.config.activation_dtype]
            dec_mask = torch.zeros(len(decodes), 1, 1, max_blocks * bs, dtype=dtype, device=dev)
            dec_mask.masked_fill_((span[None, :] >= dec_lens[:, None])[:, None, None, :],
                                  float("-inf"))
        meta = AttentionMetadata(
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=dev),
            slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=dev),
            prefill_lens=[s.num_new_tokens for s in pieces],
            prefill_starts=[s.start for s in pieces],
            prefill_block_tables=[
                torch.tensor(s.seq.block_table[: -(-(s.start + s.num_new_tokens) // bs)],
                             dtype=torch.long, device=dev) for s in pieces],
            num_decodes=len(decodes),
            decode_block_tables=dec_tables,
            decode_context_lens=dec_lens,
            decode_mask=dec_mask,
            use_flash=self.use_flash,
        )
        return meta, input_ids, positions

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> tuple[list[ScheduledSeq], torch.Tensor]:
        """Compute one step. Returns the sequences that sample and their logits rows."""
        pieces = [s for s in out.scheduled if s.num_new_tokens > 1]
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1]
        ordered = pieces + decodes
        meta, input_ids, positions = self._metadata(pieces, decodes)
        sampling: list[ScheduledSeq] = []
        logits_idx: list[int] = []
        pos = 0
        for s in ordered:
            pos += s.num_new_tokens
            if s.samples:
                sampling.append(s)
                logits_idx.append(pos - 1)
        dev = self.device
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_pool, meta, torch.tensor(logits_idx, dtype=torch.long, device=dev),
            max_position=max(positions))
        return sampling, logits.cpu()
