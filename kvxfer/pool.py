"""Zero-copy byte views of a KV block pool, in host or CUDA memory."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import blake3
import torch

from pdserve.kv_layout import KVLayout

DIGEST_HEX_CHARS = 64  # BLAKE3-256, hex
INLINE_DIGEST_BYTES = 1 << 20  # hashed on the event loop up to here (~0.2 ms); above, a thread
# With digests, runs are sent in pieces of at most this: the receiver hashes each piece as it
# lands while the next ones arrive, so only the last piece's hash adds to the transfer.
DIGEST_RUN_BYTES = 8 << 20


def digest(buf: Any) -> str:
    """BLAKE3-256 of a buffer from `PoolBytes.run`, as hex: what a write signs for each run.

    BLAKE3 because it is collision-resistant (the signature must pin the bytes against an
    attacker on the path) and ~4x faster than hashlib's BLAKE2b on one core (docs/BENCHMARKS.md);
    it releases the GIL, so callers hash in a thread. A CUDA run is hashed from a host copy.
    """
    if isinstance(buf, torch.Tensor):
        buf = buf.cpu().numpy()
    return str(blake3.blake3(buf).hexdigest())


def check_blocks(block_ids: Iterable[int], num_blocks: int, what: str) -> None:
    """Raise ValueError naming the first id outside ``[0, num_blocks)``."""
    for block in block_ids:
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < num_blocks:
            raise ValueError(f"{what} block id {block!r} is outside the pool [0, {num_blocks})")


class PoolBytes:
    """The pool as one flat byte range; `run()` hands out buffers that alias the pool.

    UCX reads from and writes into these buffers directly, so a finished recv has already
    filled the pool: there is no staging copy. Host tensors are exposed as numpy arrays
    (buffer protocol); CUDA tensors as themselves (``__cuda_array_interface__``), which keeps
    this module free of any CUDA call on a machine without a GPU.
    """

    def __init__(self, pool: torch.Tensor, layout: KVLayout) -> None:
        expected = layout.shape
        if tuple(pool.shape) != expected:
            raise ValueError(f"pool shape {tuple(pool.shape)} does not match layout {expected}")
        if str(pool.dtype).removeprefix("torch.") != layout.dtype:
            raise ValueError(f"pool dtype {pool.dtype} does not match layout dtype {layout.dtype}")
        if not pool.is_contiguous():
            raise ValueError("pool must be one contiguous tensor")
        self.layout = layout
        self.tensor = pool
        self._bytes = pool.view(-1).view(torch.uint8)
        self._block_nbytes = layout.block_nbytes

    @property
    def is_cuda(self) -> bool:
        return self._bytes.is_cuda

    def flat(self) -> Any:
        """The whole pool as one host byte array (host pools only)."""
        if self._bytes.is_cuda:
            raise ValueError("a CUDA pool has no host byte view")
        return self._bytes.numpy()

    def run(self, start: int, count: int) -> Any:
        """Buffer aliasing blocks ``[start, start + count)``."""
        if start < 0 or count < 1 or start + count > self.layout.num_blocks:
            raise ValueError(f"block run ({start}, {count}) is outside the pool")
        view = self._bytes[start * self._block_nbytes : (start + count) * self._block_nbytes]
        return view if view.is_cuda else view.numpy()
