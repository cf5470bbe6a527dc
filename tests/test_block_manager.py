"""BlockManager on its own: ref counts, chained prefix hashes, LRU eviction. No torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.engine.block_manager import BlockManager, block_hashes, hash_block

BS = 4


def _tokens(n: int, offset: int = 0) -> list[int]:
    return [offset + i for i in range(n)]


def _allocate(bm: BlockManager, rid: str, ids: list[int], *, max_cached: int | None = None,
              computed: bool = True) -> tuple[list[int], int]:
    """Allocate ``ids`` like the scheduler does and, if ``computed``, register its full blocks."""
    alloc = bm.allocate_prompt(rid, ids, len(ids),
                               max_cached=len(ids) - 1 if max_cached is None else max_cached)
    assert alloc is not None
    if computed:
        bm.register_full_blocks(rid, ids, len(ids), alloc[0])
    return alloc


def test_scheduler_and_block_manager_import_without_torch() -> None:
    code = ("import sys, pdserve.engine.block_manager, pdserve.engine.scheduler,"
            " pdserve.engine.sequence; sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_hashes_chain_over_full_blocks_only() -> None:
    ids = _tokens(11)
    hashes = block_hashes(ids, BS)
    assert len(hashes) == 2  # the 3-token tail is not a full block
    assert hashes[0] == hash_block(None, ids[:4])
    assert hashes[1] == hash_block(hashes[0], ids[4:8])
    # Same tokens under a different parent, or different extra keys, hash differently.
    assert hash_block(None, ids[4:8]) != hashes[1]
    assert block_hashes(ids, BS, b"model-a") != block_hashes(ids, BS, b"model-b")
    assert block_hashes(ids, BS, b"model-a") == block_hashes(ids, BS, b"model-a")
    # A change in block 0 changes every later hash (chaining).
    changed = block_hashes([99, *ids[1:]], BS)
    assert changed[0] != hashes[0] and changed[1] != hashes[1]


def test_fresh_allocation_and_free_restores_pool() -> None:
    bm = BlockManager(8, BS)
    table, cached = _allocate(bm, "a", _tokens(9))
    assert (len(table), cached) == (3, 0)
    assert len(set(table)) == 3
    assert bm.num_free_blocks == 5
    bm.free("a", table)
    assert bm.num_free_blocks == 8


def test_shared_prefix_blocks_are_ref_counted() -> None:
    bm = BlockManager(8, BS)
    a, _ = _allocate(bm, "a", _tokens(10))
    assert bm.num_cached_tokens(_tokens(10)) == 8  # two full blocks
    b, cached = _allocate(bm, "b", [*_tokens(8), 500, 501, 502])
    assert cached == 8
    assert b[:2] == a[:2] and b[2] != a[2]
    assert bm.num_free_blocks == 8 - 4
    assert bm.blocks_freed_by(a) == bm.blocks_freed_by(b) == 1  # only its own tail block
    bm.free("a", a)
    assert bm.num_free_blocks == 8 - 3  # a's shared blocks are still used by b
    bm.free("b", b)
    assert bm.num_free_blocks == 8
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free("b", b)


def test_max_cached_keeps_tokens_to_compute() -> None:
    bm = BlockManager(8, BS)
    ids = _tokens(8)
    first, _ = _allocate(bm, "a", ids)
    bm.free("a", first)
    # Whole prompt cached, but the caller must compute at least one token: only 1 block reused.
    b, cached = _allocate(bm, "b", ids, max_cached=len(ids) - 1, computed=False)
    assert cached == 4
    bm.free("b", b)
    # A remote prefill needs no logits here, so it may take the whole prompt from the cache.
    c, cached = _allocate(bm, "c", ids, max_cached=len(ids), computed=False)
    assert cached == 8 and c == first
    bm.free("c", c)


def test_cached_free_blocks_are_revived_without_copy() -> None:
    bm = BlockManager(4, BS)
    a, _ = _allocate(bm, "a", _tokens(8))
    bm.free("a", a)
    assert bm.num_free_blocks == 4
    # The pool is exactly full with the two cached blocks plus two new ones.
    ids = _tokens(8) + _tokens(8, 100)
    b, cached = _allocate(bm, "b", ids, max_cached=len(ids), computed=False)
    assert cached == 8 and b[:2] == a[:2]
    assert bm.num_free_blocks == 0
    assert bm.allocate_prompt("c", _tokens(1, 900), 1, max_cached=0) is None
    bm.free("b", b)


def test_unhashed_blocks_are_reused_before_cached_ones() -> None:
    bm = BlockManager(6, BS)
    cached_table, _ = _allocate(bm, "a", _tokens(8))  # 2 full, hashed blocks
    partial, _ = _allocate(bm, "b", _tokens(3, 50))  # 1 partial block: never hashed
    bm.free("a", cached_table)
    bm.free("b", partial)
    table, cached = _allocate(bm, "c", _tokens(3, 70), computed=False)
    assert cached == 0 and table == partial  # the block without a cached prefix goes first
    assert bm.num_cached_tokens(_tokens(8)) == 8  # nothing was evicted
    bm.free("c", table)


def test_lru_eviction_of_cached_free_blocks() -> None:
    bm = BlockManager(4, BS)
    a, _ = _allocate(bm, "a", _tokens(8))
    b, _ = _allocate(bm, "b", _tokens(8, 100))
    bm.free("a", a)  # freed first: evicted first
    bm.free("b", b)
    assert bm.num_cached_tokens(_tokens(8)) == 8 and bm.num_cached_tokens(_tokens(8, 100)) == 8
    c, _ = _allocate(bm, "c", _tokens(5, 200), computed=False)  # needs 2 blocks: evicts a's
    assert sorted(c) == sorted(a)
    assert bm.num_cached_tokens(_tokens(8)) == 0
    assert bm.num_cached_tokens(_tokens(8, 100)) == 8
    bm.free("c", c)
    # Within one sequence the tail block is evicted before the head: the head is the
    # prefix other prompts are likeliest to share.
    d, _ = _allocate(bm, "d", _tokens(9, 300), computed=False)  # the 2 free + 1 cached
    assert d[2] == b[1]
    assert bm.num_cached_tokens(_tokens(8, 100)) == 4
    bm.free("d", d)


def test_revived_block_moves_to_the_back_of_the_eviction_order() -> None:
    bm = BlockManager(4, BS)
    a, _ = _allocate(bm, "a", _tokens(4))
    b, _ = _allocate(bm, "b", _tokens(4, 100))
    bm.free("a", a)
    bm.free("b", b)
    again, cached = _allocate(bm, "a2", [*_tokens(4), 7], computed=False)  # reuses a's block
    assert cached == 4
    bm.free("a2", again)
    new, _ = _allocate(bm, "c", _tokens(4, 500) + _tokens(4, 600), computed=False)
    # Two unhashed free blocks exist (again's tail + one never used) -> b and a survive.
    assert bm.num_cached_tokens(_tokens(4)) == 4 and bm.num_cached_tokens(_tokens(4, 100)) == 4
    bm.free("c", new)
    e, _ = _allocate(bm, "e", _tokens(12, 700), computed=False)  # 3 blocks: evicts b first
    assert bm.num_cached_tokens(_tokens(4, 100)) == 0
    assert bm.num_cached_tokens(_tokens(4)) == 4
    bm.free("e", e)


def test_allocation_failure_changes_nothing() -> None:
    bm = BlockManager(3, BS)
    a, _ = _allocate(bm, "a", _tokens(8))
    assert bm.allocate_prompt("b", _tokens(8, 50), 8, max_cached=7) is None
    assert bm.num_free_blocks == 1
    assert bm.num_cached_tokens(_tokens(8)) == 8
    bm.free("a", a)


def test_append_slots_grows_table_or_reports_full() -> None:
    bm = BlockManager(3, BS)
    table, _ = _allocate(bm, "a", _tokens(4))
    assert bm.append_slots(table, 4) and len(table) == 1  # still fits
    assert bm.append_slots(table, 5) and len(table) == 2
    assert not bm.append_slots(table, 13)  # needs 4 blocks, only 3 exist
    assert len(table) == 2 and bm.num_free_blocks == 1
    bm.free("a", table)
    assert bm.can_allocate(3) and not bm.can_allocate(4)


def test_register_only_full_computed_blocks() -> None:
    bm = BlockManager(8, BS)
    ids = _tokens(10)
    table, _ = _allocate(bm, "a", ids, computed=False)
    bm.register_full_blocks("a", ids, 5, table)  # one full block computed so far
    assert bm.num_cached_tokens(ids) == 4
    bm.register_full_blocks("a", ids, 10, table)
    assert bm.num_cached_tokens(ids) == 8
    bm.free("a", table)


def test_prefix_caching_off_and_reset() -> None:
    off = BlockManager(4, BS, enable_prefix_caching=False)
    a, _ = _allocate(off, "a", _tokens(8))
    assert off.num_cached_tokens(_tokens(8)) == 0
    off.free("a", a)

    bm = BlockManager(4, BS)
    a, _ = _allocate(bm, "a", _tokens(8))
    b, _ = _allocate(bm, "b", _tokens(4, 100))
    bm.free("a", a)
    bm.reset_prefix_cache()  # drops a's free cached blocks, keeps b's (still in use)
    assert bm.num_cached_tokens(_tokens(8)) == 0
    assert bm.num_cached_tokens(_tokens(4, 100)) == 4
    bm.free("b", b)


def test_prefix_hit_rate_counts_tokens() -> None:
    bm = BlockManager(8, BS)
    assert bm.prefix_hit_rate == 0.0
    a, _ = _allocate(bm, "a", _tokens(8))
    b, _ = _allocate(bm, "b", _tokens(8))  # 4 of 8 tokens hit (one must be computed)
    assert bm.prefix_hit_rate == pytest.approx(4 / 16)
    bm.free("a", a)
    bm.free("b", b)


def test_each_block_is_hashed_once_per_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lookup, allocation, registration and re-allocation after a preemption share the
    sequence's hash list: no block is hashed twice."""
    import pdserve.engine.block_manager as block_manager

    ids = _tokens(10)
    expected = block_hashes(ids, BS)
    hashed: list[tuple[int, ...]] = []
    real = block_manager.hash_block

    def counting(parent, tokens, extra=b""):  # type: ignore[no-untyped-def]
        hashed.append(tuple(tokens))
        return real(parent, tokens, extra)

    monkeypatch.setattr(block_manager, "hash_block", counting)
    bm = BlockManager(8, BS)
    seq_hashes: list = []
    assert bm.num_cached_tokens(ids, seq_hashes) == 0
    assert len(hashed) == 1  # a lookup stops at the first miss
    alloc = bm.allocate_prompt("a", ids, len(ids), max_cached=9, block_hashes=seq_hashes)
    assert alloc is not None and alloc[1] == 0
    bm.register_full_blocks("a", ids, len(ids), alloc[0])
    assert seq_hashes == expected and len(hashed) == 2
    bm.free("a", alloc[0])  # preempted: the blocks stay cached, the sequence keeps its hashes
    again = bm.allocate_prompt("a", ids, len(ids), max_cached=9, block_hashes=seq_hashes)
    assert again is not None and again[1] == 8
    bm.register_full_blocks("a", ids, len(ids), again[0])
    assert len(hashed) == 2 and hashed == [tuple(ids[:4]), tuple(ids[4:8])]
    bm.free("a", again[0])
