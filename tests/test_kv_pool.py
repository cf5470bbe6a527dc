"""The KV pool's allocation: zeroed, contiguous, in huge pages where the kernel grants them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pdserve.engine.model_runner import kv_pool_tensor, memory_available
from pdserve.errors import ModelLoadError

SHAPE = (64, 2, 2, 16, 3, 64)  # 3 MiB of float32: spans at least one aligned 2 MiB page


def _anon_huge_kb() -> int:
    text = Path("/proc/self/smaps_rollup").read_text()
    return int(text.split("AnonHugePages:")[1].split()[0])


def test_pool_is_zeroed_contiguous_and_writable() -> None:
    pool = kv_pool_tensor(SHAPE, torch.float32, torch.device("cpu"))
    assert pool.shape == SHAPE and pool.is_contiguous() and pool.dtype == torch.float32
    assert not pool.any()
    pool[3, 1] = 1.0
    assert pool.sum().item() == 2 * 16 * 3 * 64


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="Linux only")
def test_pool_is_in_huge_pages_where_the_kernel_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    before = _anon_huge_kb()
    pool = kv_pool_tensor((256, *SHAPE[1:]), torch.float32, torch.device("cpu"))  # 12 MiB
    assert _anon_huge_kb() - before >= 2048
    del pool
    monkeypatch.setenv("PDSERVE_NO_KV_HUGEPAGES", "1")
    plain = kv_pool_tensor((256, *SHAPE[1:]), torch.float32, torch.device("cpu"))
    assert not plain.any()


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="Linux only")
def test_a_pool_larger_than_the_memory_available_is_refused_before_any_is_touched() -> None:
    free = memory_available()
    assert free is not None and free > 0
    rows = (2 * free) // (math.prod(SHAPE[1:]) * 4) + 1  # twice what this host has left
    with pytest.raises(ModelLoadError, match="lower --kv-cache-mb"):
        kv_pool_tensor((rows, *SHAPE[1:]), torch.float32, torch.device("cpu"))
