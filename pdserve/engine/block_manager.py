"""KV block allocation with reference counts and prefix caching. Plain Python: no torch.

Blocks are ids into the engine's KV pool. A block is *in use* while its ref count is > 0. A
block whose tokens are complete gets a chained hash (parent hash, its tokens, extra keys such
as the model identity), so a later prompt with the same prefix can share it. Free blocks that
still hold a hashed prefix stay in the cache and are evicted least-recently-freed first.

Hashes are work done once per sequence (as vLLM v1 keeps ``block_hashes`` on the request): a
sequence owns the list of its full blocks' hashes (`Sequence.block_hashes`) and this manager
extends it lazily, block by block, as lookups, allocation and registration need more. A
preempted and re-admitted sequence, or one that is looked up then allocated, never hashes a
block twice.

With `record_events`, every hash the cache gains (`STORED`) or loses (`REMOVED`) is queued in
order for `drain_events` (see pdserve.kv_events): routers keep an exact copy of the cache from
them. The queue is bounded; past its bound it is dropped and `events_overflowed` is set, and
the owner publishes a snapshot (`take_snapshot`) instead.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Container
from collections.abc import Sequence as Seq
from typing import NewType

from pdserve.kv_events import KVOp

BlockHash = NewType("BlockHash", bytes)


def hash_block(parent: BlockHash | None, tokens: Seq[int], extra: bytes = b"") -> BlockHash:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(array("i", tokens).tobytes())  # int32: one BLAKE2b compression per block
    h.update(extra)
    return BlockHash(h.digest())


def block_hashes(token_ids: Seq[int], block_size: int, extra: bytes = b"",
                 stop: Container[bytes] | None = None) -> list[BlockHash]:
    """Chained hashes of every *full* block of ``token_ids``: `hash_block` down the prompt,
    with the token bytes packed once. With `stop`, the list ends before the first hash that
    is not a key of it (a prefix index: no later block can match once one does not).

    The router hashes every prompt it places, so this runs in C where the extension
    (pdserve/_blockhash.c) was built; the Python loop below gives the same digests."""
    if _native_chain is not None:
        return _native_chain(token_ids, block_size, extra, stop)  # type: ignore[return-value]
    n = len(token_ids) // block_size
    raw = array("i", token_ids[: n * block_size]).tobytes()
    return _chain(memoryview(raw), block_size * 4, extra, stop)


def _chain(raw: memoryview, step: int, extra: bytes,
           stop: Container[bytes] | None) -> list[BlockHash]:
    parent = b"\0" * 16
    hashes: list[BlockHash] = []
    for off in range(0, len(raw) - step + 1, step):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(raw[off : off + step])
        h.update(extra)
        parent = h.digest()
        if stop is not None and parent not in stop:
            break
        hashes.append(BlockHash(parent))
    return hashes


# `stop` in C: a dict or a pdserve._blockhash.BlockTable (router.kv_index's holders).
_native_chain: Callable[[Seq[int], int, bytes, Container[bytes] | None], list[bytes]] | None
try:
    from pdserve._blockhash import chain as _native_chain
except ImportError:  # not compiled here (setup.py builds it where a C compiler exists)
    _native_chain = None


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation is attempted without checking `can_allocate` first."""


class BlockManager:
    """Owns the ref counts, the hash index and the free list of ``num_blocks`` KV blocks."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 hash_extra: bytes = b"", record_events: bool = False,
                 max_pending_events: int = 1 << 20):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_extra = hash_extra
        self._ref = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        # Free blocks in eviction order: first = evicted first. Values unused.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # Per live sequence: its hash list (the sequence's own, extended here) and how many
        # of its leading blocks are accounted for (shared from the cache or registered).
        self._seq_hashes: dict[str, list[BlockHash]] = {}
        self._num_registered: dict[str, int] = {}
        self.prefix_queries = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        self._events: list[tuple[KVOp, BlockHash]] | None = [] if record_events else None
        self._max_pending_events = max_pending_events
        self.events_overflowed = False
        self.event_count = 0  # cache changes ever recorded: cheap to poll from another thread

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def blocks_freed_by(self, block_table: Seq[int]) -> int:
        """How many blocks freeing ``block_table`` would return to the free list (those it
        alone holds)."""
        return sum(1 for b in set(block_table) if self._ref[b] == 1)

    def extend_hashes(self, hashes: list[BlockHash], token_ids: Seq[int],
                      num_blocks: int) -> list[BlockHash]:
        """Extend ``hashes`` (in place) to the first ``num_blocks`` full blocks of
        ``token_ids``; the hashes already there are trusted, never recomputed."""
        bs = self.block_size
        num_blocks = min(num_blocks, len(token_ids) // bs)
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None,
                                     token_ids[i * bs : (i + 1) * bs], self.hash_extra))
        return hashes

    def _matched_blocks(self, token_ids: Seq[int], hashes: list[BlockHash],
                        max_blocks: int) -> list[int]:
        """Cached blocks holding the leading full blocks of ``token_ids`` (at most
        ``max_blocks``). Hashes only up to the first miss."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        while len(hits) < max_blocks:
            if len(self.extend_hashes(hashes, token_ids, len(hits) + 1)) <= len(hits):
                break  # no further full block
            block = self._cached.get(hashes[len(hits)])
            if block is None:
                break
            hits.append(block)
        return hits

    def num_cached_tokens(self, token_ids: Seq[int],
                          block_hashes: list[BlockHash] | None = None) -> int:
        """How many leading tokens of ``token_ids`` are in the prefix cache (block aligned).

        ``block_hashes``: the sequence's hash list, extended as far as the lookup goes."""
        hashes = [] if block_hashes is None else block_hashes
        return len(self._matched_blocks(token_ids, hashes, len(token_ids))) * self.block_size

    @property
    def prefix_hit_rate(self) -> float:
        if not self.prefix_query_tokens:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_query_tokens

    # ------------------------------------------------------------------ allocation

    def allocate_prompt(self, request_id: str, token_ids: Seq[int], num_tokens: int,
                        *, max_cached: int, block_hashes: list[BlockHash] | None = None
                        ) -> tuple[list[int], int] | None:
        """Blocks for the first ``num_tokens`` tokens, reusing cached prefix blocks.

        At most ``max_cached`` tokens are taken from the cache (callers keep at least one token
        to compute so they get logits). Returns (block_table, num_cached_tokens), or None when
        there are not enough free blocks (nothing is changed then). ``block_hashes`` is the
        sequence's own hash list: it is extended here and by `register_full_blocks`, and kept
        by the caller across preemptions (the tokens do not change).
        """
        hashes = [] if block_hashes is None else block_hashes
        hits = self._matched_blocks(token_ids, hashes, max(0, max_cached) // self.block_size)
        need_total = self.blocks_needed(num_tokens)
        # Hit blocks that are free right now leave the free list when we take them.
        free_hits = sum(1 for b in hits if self._ref[b] == 0)
        if need_total - len(hits) + free_hits > len(self._free):
            return None
        for b in hits:
            self._take(b)
        table = hits + [self._pop_free() for _ in range(need_total - len(hits))]
        num_cached = len(hits) * self.block_size
        self._seq_hashes[request_id] = hashes
        self._num_registered[request_id] = len(hits)
        self.prefix_queries += 1
        self.prefix_query_tokens += len(token_ids)
        self.prefix_hit_tokens += num_cached
        return table, num_cached

    def append_slots(self, block_table: list[int], num_tokens: int) -> bool:
        """Grow ``block_table`` to hold ``num_tokens`` tokens. False (and no change) if full."""
        need = self.blocks_needed(num_tokens) - len(block_table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        block_table.extend(self._pop_free() for _ in range(need))
        return True

    def register_full_blocks(self, request_id: str, token_ids: Seq[int], num_computed: int,
                             block_table: Seq[int]) -> None:
        """Record hashes of blocks whose KV is now complete, so later prompts can reuse them."""
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes.setdefault(request_id, [])
        done = self._num_registered.get(request_id, 0)
        num_full = num_computed // self.block_size
        self.extend_hashes(hashes, token_ids, num_full)
        self._num_registered[request_id] = max(done, num_full)
        for i in range(done, num_full):
            h, block = hashes[i], block_table[i]
            if h not in self._cached and self._hash_of[block] is None:
                self._cached[h] = block
                self._hash_of[block] = h
                self._event(KVOp.STORED, h)

    def free(self, request_id: str, block_table: Seq[int]) -> None:
        """Drop one reference to each block; blocks reaching zero become free (tail first)."""
        self._seq_hashes.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        for b in reversed(block_table):
            self._ref[b] -= 1
            assert self._ref[b] >= 0, f"block {b} freed twice"
            if self._ref[b] == 0:
                if self._hash_of[b] is None:
                    self._free[b] = None
                    self._free.move_to_end(b, last=False)  # nothing cached: reuse first
                else:
                    self._free[b] = None

    def reset_prefix_cache(self) -> None:
        for h, b in list(self._cached.items()):
            if self._ref[b] == 0:
                del self._cached[h]
                self._hash_of[b] = None
                self._event(KVOp.REMOVED, h)

    # ------------------------------------------------------------------ KV events

    def enable_events(self) -> None:
        """Start queueing cache changes (idempotent); the first `take_snapshot` after this is
        the baseline they apply to."""
        if self._events is None:
            self._events = []

    def drain_events(self) -> list[tuple[KVOp, BlockHash]]:
        """The cache changes since the last drain, in order (empty unless `record_events`).
        After an overflow this is empty until `take_snapshot` resynchronises the owner."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash the cache holds now."""
        return list(self._cached)

    def take_snapshot(self) -> list[BlockHash]:
        """`cached_hashes`, as the new baseline for events: drops the queued events and
        clears the overflow (the snapshot supersedes them)."""
        if self._events is not None:
            self._events = []
        self.events_overflowed = False
        return list(self._cached)

    def _event(self, op: KVOp, h: BlockHash) -> None:
        events = self._events
        if events is None:
            return
        self.event_count += 1
        if self.events_overflowed:
            return
        if len(events) >= self._max_pending_events:
            events.clear()
            self.events_overflowed = True
            return
        events.append((op, h))

    # ------------------------------------------------------------------ internals

    def _take(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._free[block]
        self._ref[block] += 1

    def _pop_free(self) -> int:
        if not self._free:
            raise OutOfBlocksError("no free KV blocks")
        block, _ = self._free.popitem(last=False)
        h = self._hash_of[block]
        if h is not None:  # evict the cached prefix this block held
            self._hash_of[block] = None
            if self._cached.get(h) == block:
                del self._cached[h]
                self._event(KVOp.REMOVED, h)
        self._ref[block] = 1
        return block
