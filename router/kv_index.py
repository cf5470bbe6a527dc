"""An exact index of which worker holds which prefix block, kept from KV events.

Decode and prefill workers are indexed alike, in one index: worker ids are unique across
roles (one registry key per id), a prompt's walk answers for both roles at once, and the
caller picks the candidates of each role from the answer (router.placement).

Workers publish every block their prefix cache stores or evicts (pdserve.kv_events); the
router folds those batches in here, in order, and asks this index, not the workers, how much
of a prompt each one holds. Block hashes are chained (a block's hash covers every token before
it), so a worker holds a prompt's first k blocks exactly when it holds the hashes of blocks
1..k; `match` finds that k for every worker in one walk over the prompt's hashes.

Exactness rests on the numbering: a worker's batches carry (epoch, seq). A batch that is not
the next one (a gap: an entry trimmed, lost while Redis was down, or a malformed one), a new
epoch that does not open with a snapshot, or more blocks than any worker could hold, drops
what the index knew of that worker and answers RESYNC; the caller then asks the worker for a
snapshot, and until it arrives the worker simply counts as holding nothing (routing degrades
to load balancing, never to a wrong answer about KV). Plain Python, no I/O.

Memory: one entry per distinct block (its hash and an int bitmask of holders: a 32-byte slot
of pdserve._blockhash.BlockTable where that is built, a dict entry otherwise) plus one entry
per (worker, block) in its worker's dict; `memory_bytes()` measures it.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import numpy as np
import numpy.typing as npt

from pdserve.engine.block_manager import block_hashes
from pdserve.kv_events import KVEventBatch, KVOp

if TYPE_CHECKING:
    from pdserve._blockhash import BlockTable


# Block hash -> int bitmask of the slots holding it.
Holders: TypeAlias = "dict[bytes, int] | BlockTable"

_native_match: Callable[[Sequence[int], int, bytes, Holders], list[tuple[int, int]]] | None
Positions: TypeAlias = "npt.NDArray[np.intp]"
Floats: TypeAlias = "npt.NDArray[np.float64]"
_native_spread: Callable[[list[tuple[int, int]], Positions, Floats, float], None] | None
_new_holders: Callable[[], Holders]
try:
    # The digests in one flat array (one cache line a lookup, on huge pages where the kernel
    # allows) instead of a dict whose lookup touches four places in memory: the router's
    # walk over a 1M-block index is mostly waiting on those (pdserve/_blockhash.c).
    from pdserve._blockhash import BlockTable as _new_holders
    from pdserve._blockhash import match as _native_match
    from pdserve._blockhash import spread as _native_spread
except ImportError:  # not compiled here: hash in Python, then walk (the same answer)
    _native_match = _native_spread = None
    _new_holders = dict


def spread(pairs: list[tuple[int, int]], positions: Positions, out: Floats,
           scale: float) -> None:
    """out[positions[slot]] = depth * scale for every slot bit of `KVIndex.walk`'s pairs
    whose slot has a position (>= 0; a slot past the end of `positions` has none): the walk
    written where a caller keeps its candidates, in one C call where it was built."""
    if _native_spread is not None:
        _native_spread(pairs, positions, out, scale)
        return
    n = len(positions)
    for depth, gone in pairs:
        while gone:
            low = gone & -gone
            slot = low.bit_length() - 1
            if slot < n and (i := int(positions[slot])) >= 0:
                out[i] = depth * scale
            gone ^= low


class Applied(enum.Enum):
    OK = "ok"
    STALE = "stale"  # an old epoch's or an already-applied batch: ignored
    RESYNC = "resync"  # the worker's view was dropped: request a snapshot


@dataclass
class _Worker:
    slot: int
    # The worker's blocks, as the keys of a dict of None rather than a set: a dict holding
    # only bytes and None is not tracked by the cyclic GC (a set always is), so a full
    # collection does not walk ~1M entries: ~140 ms with sets at 1M blocks, each a pause for
    # every request in the router (tests/test_kv_index.py checks it stays untracked).
    held: dict[bytes, None]
    epoch: int = -1
    seq: int = 0
    block_size: int = 0
    synced: bool = False


class KVIndex:
    """Block hash -> holders, for every worker the caller follows (any role)."""

    def __init__(self, *, max_blocks_per_worker: int = 1 << 22):
        self.max_blocks_per_worker = max_blocks_per_worker
        self._workers: dict[str, _Worker] = {}
        self._ids: list[str | None] = []  # slot -> worker id
        self._free_slots: list[int] = []
        self._holders: Holders = _new_holders()  # hash -> bitmask of slots
        self._geometry: dict[str, int] = {}  # synced worker -> block size
        self.geometry_version = 0  # grows whenever `geometry()` changes
        self.ops_applied = 0
        self.resyncs = 0

    # ------------------------------------------------------------------ queries

    def match(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """worker id -> how many leading blocks of `hashes` it holds (workers holding none
        are absent). One walk: the set of workers still matching shrinks block by block."""
        out: dict[str, int] = {}
        for depth, gone in self._pairs(hashes):
            self._record(out, depth, gone)
        return out

    def _pairs(self, hashes: Sequence[bytes]) -> list[tuple[int, int]]:
        """`walk`'s (depth, slot mask) pairs of these hashes, in Python."""
        out: list[tuple[int, int]] = []
        if not hashes:
            return out
        holders = self._holders
        active = holders.get(hashes[0], 0)
        depth = 0
        n = len(hashes)
        while active:
            depth += 1
            still = active & holders.get(hashes[depth], 0) if depth < n else 0
            if gone := active & ~still:
                out.append((depth, gone))
            active = still
        return out

    def walk(self, token_ids: Sequence[int], block_size: int,
             extra: bytes = b"") -> list[tuple[int, int]]:
        """The prompt's prefix walk as (depth, mask) pairs: the workers whose slot bits are
        set in a mask hold exactly its first `depth` blocks (`slot`; `spread` writes them
        where a caller wants them). Hashes only as far as some worker still holds every
        block (in C where pdserve/_blockhash.c was built: the walk and the hashing in one
        call)."""
        if _native_match is None:
            return self._pairs(block_hashes(token_ids, block_size, extra, stop=self._holders))
        return _native_match(token_ids, block_size, extra, self._holders)

    def match_prompt(self, token_ids: Sequence[int], block_size: int,
                     extra: bytes = b"") -> dict[str, int]:
        """`match` of the prompt's chained block hashes (`walk`)."""
        out: dict[str, int] = {}
        for depth, gone in self.walk(token_ids, block_size, extra):
            self._record(out, depth, gone)
        return out

    def slot(self, worker_id: str) -> int | None:
        """The worker's bit in `walk`'s masks (None: not followed). A worker in `geometry()`
        keeps its slot until `geometry_version` changes."""
        w = self._workers.get(worker_id)
        return None if w is None else w.slot

    def _record(self, out: dict[str, int], depth: int, gone: int) -> None:
        """out[w] = depth for every worker whose slot bit is set in `gone`."""
        ids = self._ids
        while gone:
            low = gone & -gone
            worker_id = ids[low.bit_length() - 1]
            if worker_id is not None:
                out[worker_id] = depth
            gone ^= low

    def geometry(self) -> Mapping[str, int]:
        """worker id -> block size, for the workers whose snapshot arrived."""
        return self._geometry

    def synced(self, worker_id: str) -> bool:
        w = self._workers.get(worker_id)
        return w is not None and w.synced

    def block_size(self, worker_id: str) -> int | None:
        """The worker's block size, once a snapshot told it."""
        w = self._workers.get(worker_id)
        return w.block_size if w is not None and w.synced else None

    def held(self, worker_id: str) -> frozenset[bytes]:
        w = self._workers.get(worker_id)
        return frozenset(w.held) if w is not None else frozenset()

    @property
    def workers(self) -> list[str]:
        return list(self._workers)

    @property
    def num_blocks(self) -> int:
        """Distinct blocks held by any worker."""
        return len(self._holders)

    @property
    def num_entries(self) -> int:
        """(worker, block) pairs."""
        return sum(len(w.held) for w in self._workers.values())

    def memory_bytes(self) -> int:
        """The index's own memory: the dicts' tables, hash keys and bitmask values. Each
        holder keeps its own copy of a hash (decoded from its own batches; the dict shares
        the first holder's), so a key counts once per holder."""
        total = sys.getsizeof(self._holders)  # a BlockTable's __sizeof__ counts its masks
        boxed = isinstance(self._holders, dict)
        for h, mask in self._holders.items():
            total += sys.getsizeof(h) * mask.bit_count() + (
                sys.getsizeof(mask) if boxed and mask > 256 else 0)
        for w in self._workers.values():
            total += sys.getsizeof(w.held)
        return total

    # ------------------------------------------------------------------ updates

    def apply(self, worker_id: str, batch: KVEventBatch) -> Applied:
        w = self._workers.get(worker_id)
        if w is None:
            w = self._add(worker_id)
        if batch.snapshot:
            if w.synced and batch.epoch == w.epoch and batch.seq <= w.seq:
                return Applied.STALE
            if w.synced and batch.epoch < w.epoch:
                return Applied.STALE
            self._clear(w)
            w.epoch, w.seq, w.block_size, w.synced = batch.epoch, batch.seq, batch.block_size, True
            self._set_geometry(worker_id, batch.block_size)
            return self._ops(worker_id, w, batch)
        if not w.synced:
            return Applied.RESYNC  # waiting for a snapshot: increments mean nothing yet
        if batch.epoch < w.epoch or (batch.epoch == w.epoch and batch.seq <= w.seq):
            return Applied.STALE
        if batch.epoch > w.epoch or batch.seq != w.seq + 1 or batch.block_size != w.block_size:
            return self._resync(w)
        w.seq = batch.seq
        return self._ops(worker_id, w, batch)

    def invalid(self, worker_id: str) -> Applied:
        """A malformed entry from this worker: a gap like any other."""
        w = self._workers.get(worker_id) or self._add(worker_id)
        return self._resync(w)

    def remove_worker(self, worker_id: str) -> None:
        w = self._workers.pop(worker_id, None)
        self._set_geometry(worker_id, None)
        if w is None:
            return
        self._clear(w)
        self._ids[w.slot] = None
        self._free_slots.append(w.slot)

    def sync_workers(self, worker_ids: Iterable[str]) -> None:
        """Forget workers not in `worker_ids` (they left the directory)."""
        keep = set(worker_ids)
        for worker_id in [w for w in self._workers if w not in keep]:
            self.remove_worker(worker_id)

    # ------------------------------------------------------------------ internals

    def _add(self, worker_id: str) -> _Worker:
        if self._free_slots:
            slot = self._free_slots.pop()
            self._ids[slot] = worker_id
        else:
            slot = len(self._ids)
            self._ids.append(worker_id)
        w = self._workers[worker_id] = _Worker(slot, {})
        return w

    def _ops(self, worker_id: str, w: _Worker, batch: KVEventBatch) -> Applied:
        holders, held, bit = self._holders, w.held, 1 << w.slot
        for op, h in batch.ops:
            if op is KVOp.STORED:
                if h not in held:
                    held[h] = None
                    holders[h] = holders.get(h, 0) | bit
            elif h in held:
                del held[h]
                mask = holders[h] & ~bit
                if mask:
                    holders[h] = mask
                else:
                    del holders[h]
        self.ops_applied += len(batch.ops)
        if len(held) > self.max_blocks_per_worker:
            return self._resync(w)
        return Applied.OK

    def _set_geometry(self, worker_id: str, block_size: int | None) -> None:
        if self._geometry.get(worker_id) != block_size:
            if block_size is None:
                del self._geometry[worker_id]
            else:
                self._geometry[worker_id] = block_size
            self.geometry_version += 1

    def _clear(self, w: _Worker) -> None:
        holders, bit = self._holders, 1 << w.slot
        for h in w.held:
            mask = holders[h] & ~bit
            if mask:
                holders[h] = mask
            else:
                del holders[h]
        w.held = {}

    def _resync(self, w: _Worker) -> Applied:
        self._clear(w)
        w.synced = False
        worker_id = self._ids[w.slot]
        if worker_id is not None:
            self._set_geometry(worker_id, None)
        self.resyncs += 1
        return Applied.RESYNC
