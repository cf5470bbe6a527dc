"""KV cache events: which prefix blocks a decode worker stores and evicts, as routers see them.

A worker's block manager registers a block under its chained hash when the block's KV is
complete (`stored`) and drops the hash when the block is reused for something else
(`removed`). Workers publish these in batches, numbered 1, 2, 3, ... per worker epoch, on
their own Redis stream (`pdserve.control.kv_events`); routers fold them into an exact index of
who holds which block (`router.kv_index`) and so need no per-request question to any worker.

A *snapshot* batch lists every block the worker holds and replaces what a reader knew: it
opens each epoch and answers a reader that saw a gap in the numbering.

The codec is fixed-width bytes, never code-executing: each op is one byte (`+` stored, `-`
removed) and a 16-byte block hash. This module imports nothing from the project.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

HASH_BYTES = 16  # blake2b digest size of pdserve.engine.block_manager.hash_block
_OP_BYTES = 1 + HASH_BYTES


class KVEventError(ValueError):
    """A KV event record is malformed."""


class KVOp(enum.IntEnum):
    STORED = ord("+")
    REMOVED = ord("-")


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """One published batch. `ops` is in the order the block manager did them: a hash may be
    removed and stored again within one batch. A snapshot's ops are all STORED."""

    epoch: int
    seq: int
    block_size: int
    ops: tuple[tuple[KVOp, bytes], ...] = ()
    snapshot: bool = False

    def __post_init__(self) -> None:
        for name in ("epoch", "seq", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise KVEventError(f"{name} must be an integer >= 0, got {value!r}")
        if self.block_size < 1:
            raise KVEventError(f"block_size must be >= 1, got {self.block_size}")
        if self.snapshot and any(op is not KVOp.STORED for op, _ in self.ops):
            raise KVEventError("a snapshot holds stored blocks only")

    # ------------------------------------------------------------------ codec

    def to_fields(self) -> dict[bytes, bytes]:
        """Redis stream entry fields."""
        return {
            b"epoch": str(self.epoch).encode(),
            b"seq": str(self.seq).encode(),
            b"bs": str(self.block_size).encode(),
            b"snap": b"1" if self.snapshot else b"0",
            b"ops": encode_ops(self.ops),
        }

    @classmethod
    def from_fields(cls, fields: Mapping[bytes, bytes], *, max_ops: int) -> KVEventBatch:
        """Parse an entry; anything malformed (or over `max_ops` ops) is a KVEventError."""
        try:
            epoch = int(fields[b"epoch"])
            seq = int(fields[b"seq"])
            block_size = int(fields[b"bs"])
            snap = fields[b"snap"]
            raw = fields[b"ops"]
        except (KeyError, ValueError, TypeError) as exc:
            raise KVEventError(f"malformed KV event entry: {exc!r}") from exc
        if snap not in (b"0", b"1"):
            raise KVEventError(f"snap must be 0 or 1, got {snap!r}")
        return cls(epoch, seq, block_size, decode_ops(raw, max_ops=max_ops), snapshot=snap == b"1")


def encode_ops(ops: Iterable[tuple[KVOp, bytes]]) -> bytes:
    out = bytearray()
    for op, h in ops:
        if len(h) != HASH_BYTES:
            raise KVEventError(f"block hash must be {HASH_BYTES} bytes, got {len(h)}")
        out.append(op)
        out += h
    return bytes(out)


def decode_ops(raw: bytes, *, max_ops: int) -> tuple[tuple[KVOp, bytes], ...]:
    if not isinstance(raw, bytes | bytearray) or len(raw) % _OP_BYTES:
        raise KVEventError(f"ops must be a multiple of {_OP_BYTES} bytes")
    n = len(raw) // _OP_BYTES
    if n > max_ops:
        raise KVEventError(f"{n} ops in one entry, more than the {max_ops} allowed")
    ops = []
    for i in range(0, len(raw), _OP_BYTES):
        op = _OPS.get(raw[i])
        if op is None:
            raise KVEventError(f"unknown KV op {raw[i]!r}")
        ops.append((op, bytes(raw[i + 1 : i + _OP_BYTES])))
    return tuple(ops)


_OPS = {op.value: op for op in KVOp}  # the enum's constructor costs ~0.45 us an op
