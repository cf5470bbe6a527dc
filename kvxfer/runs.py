"""Coalescing block ids into contiguous runs, so a transfer is a few large messages."""

from __future__ import annotations

from collections.abc import Sequence


def merge_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """``[4, 5, 6, 9, 2, 3]`` -> ``[(4, 3), (9, 1), (2, 2)]``: (start, count), order kept.

    Only ids that follow each other in the list *and* in value are merged, so expanding the
    runs gives back exactly `block_ids`.
    """
    runs: list[tuple[int, int]] = []
    for block in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block:
            start, count = runs[-1]
            runs[-1] = (start, count + 1)
        else:
            runs.append((block, 1))
    return runs


def merge_pairs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs of a block-to-block copy ``src_ids[i] -> dst_ids[i]``: (src_start, dst_start, count).

    A run grows only while both sides stay consecutive, e.g. src ``[0, 1, 2]`` -> dst
    ``[7, 8, 3]`` is ``[(0, 7, 2), (2, 3, 1)]``.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(src_ids, dst_ids, strict=True):
        if runs:
            src_start, dst_start, count = runs[-1]
            if src_start + count == src and dst_start + count == dst:
                runs[-1] = (src_start, dst_start, count + 1)
                continue
        runs.append((src, dst, 1))
    return runs


def split_runs(runs: Sequence[tuple[int, int, int]], max_count: int
               ) -> list[tuple[int, int, int]]:
    """`merge_pairs` runs cut into pieces of at most `max_count` blocks, order kept:
    ``[(0, 7, 5)]`` with 2 -> ``[(0, 7, 2), (2, 9, 2), (4, 11, 1)]``."""
    if max_count < 1:
        raise ValueError("max_count must be >= 1")
    return [(src + off, dst + off, min(max_count, count - off))
            for src, dst, count in runs for off in range(0, count, max_count)]


def expand_runs(runs: Sequence[tuple[int, int]]) -> list[int]:
    return [block for start, count in runs for block in range(start, start + count)]
