"""KV pool geometry (`KVLayout`) and where a prompt's KV goes (`KVDestination`).

Part of the shared vocabulary, beside `pdserve.types`: it imports nothing from the project,
so the engine, kvxfer, the control plane and the gRPC conversions all read one definition.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_KV_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class KVLayout:
    """Shape of a KV block pool: enough to address any block's bytes from outside the engine.

    The one source of KV geometry: the engine allocates its pool as `shape`, KV transfer
    addresses blocks by `block_nbytes`, and descriptors (Redis JSON) and protos carry it as
    `to_wire()` / `from_wire()`.

    The pool is ONE contiguous tensor of shape
    ``[num_blocks, num_layers, 2 (k, v), block_size, num_kv_heads, head_dim]`` (block-major),
    so block ``b`` is the byte range ``[b * block_nbytes, (b + 1) * block_nbytes)`` and a run of
    consecutive block ids is one contiguous range.
    """

    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    model_id: str  # identity of the weights; KV from another model must never be mixed in

    @classmethod
    def for_budget(cls, nbytes: int, *, num_layers: int, block_size: int, num_kv_heads: int,
                   head_dim: int, dtype: str, model_id: str, min_blocks: int = 2) -> KVLayout:
        """The layout with as many blocks as fit in ``nbytes`` (at least ``min_blocks``)."""
        one = cls(1, num_layers, block_size, num_kv_heads, head_dim, dtype, model_id)
        return dataclasses.replace(one, num_blocks=max(min_blocks, nbytes // one.block_nbytes))

    @property
    def itemsize(self) -> int:
        return _KV_ITEMSIZE[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """One block: ``(num_layers, 2, block_size, num_kv_heads, head_dim)``."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """The whole pool tensor's shape."""
        return (self.num_blocks, *self.block_shape)

    @property
    def block_nbytes(self) -> int:
        return math.prod(self.block_shape) * self.itemsize

    @property
    def pool_nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes

    @property
    def num_tokens(self) -> int:
        """Tokens the whole pool can hold."""
        return self.num_blocks * self.block_size

    def compatible_with(self, other: KVLayout) -> bool:
        """Same per-block layout and model: blocks may be copied between the two pools."""
        return (
            self.num_layers == other.num_layers
            and self.block_size == other.block_size
            and self.num_kv_heads == other.num_kv_heads
            and self.head_dim == other.head_dim
            and self.dtype == other.dtype
            and self.model_id == other.model_id
        )

    # ------------------------------------------------------------------ the one codec

    def to_wire(self) -> dict[str, Any]:
        """Field name -> value (int or str), the form every encoding carries (JSON, protobuf
        fields)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_wire(cls, data: Any) -> KVLayout:
        """The inverse of `to_wire`, validated: raises ValueError naming the bad field.

        Accepts a mapping (decoded JSON) or any object with the fields as attributes (a
        protobuf message), so every encoding is read and checked the same way.
        """
        def get(name: str) -> Any:
            if isinstance(data, Mapping):
                if name not in data:
                    raise ValueError(f"layout is missing field {name!r}")
                return data[name]
            if not hasattr(data, name):
                raise ValueError(f"layout is missing field {name!r}")
            return getattr(data, name)

        if data is None or isinstance(data, str | bytes | int | float | list):
            raise ValueError(f"layout must be an object, got {type(data).__name__}")
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            v = get(f.name)
            if f.type == "int":
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise ValueError(f"layout field {f.name!r} must be an integer >= 0")
            elif not isinstance(v, str):
                raise ValueError(f"layout field {f.name!r} must be a string")
            values[f.name] = v
        if values["dtype"] not in _KV_ITEMSIZE:
            raise ValueError(f"layout dtype {values['dtype']!r} is not one of "
                             f"{sorted(_KV_ITEMSIZE)}")
        return cls(**values)


@dataclass(frozen=True)
class KVDestination:
    """Where a prompt's KV goes: blocks a decode worker reserved for it (the first message of
    its AllocateAndGenerate stream) that a prefill worker writes into (Prefill's
    `destination`). The one type on every side of the handover; pdserve.rpc.convert maps it
    to and from the protos."""

    request_id: str
    block_ids: tuple[int, ...]  # the prompt's blocks, in order (cached ones first)
    num_cached_tokens: int  # already filled on the decode worker: not sent again
    descriptor_id: str  # the decode worker's registered KV pool
    transfer_id: str  # names this transfer in the sender's completion notice
    layout: KVLayout | None = None  # the decode worker's pool (its allocation tells it)
