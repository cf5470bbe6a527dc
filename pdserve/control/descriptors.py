"""KV memory descriptors: what a KV sender needs to know to write into a remote block pool.

A decode worker publishes one descriptor per incarnation. Its id carries the worker's epoch
(``"{worker_id}:{epoch}"``), so a sender holding a descriptor from before a restart is
rejected by the new incarnation instead of writing into blocks it no longer owns.

Torch-free and Redis-free: the KV transfer package uses these records too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pdserve.kv_layout import KVLayout


class DescriptorFormatError(ValueError):
    """A stored or received descriptor is not valid JSON of the expected shape."""


def make_descriptor_id(worker_id: str, epoch: int) -> str:
    return f"{worker_id}:{epoch}"


def parse_descriptor_id(descriptor_id: str) -> tuple[str, int]:
    """Split ``"{worker_id}:{epoch}"``; raises DescriptorFormatError when malformed."""
    worker_id, sep, epoch = descriptor_id.rpartition(":")
    if not sep or not worker_id or not epoch.isdigit():
        raise DescriptorFormatError(
            f"descriptor id {descriptor_id!r} is not of the form '<worker_id>:<epoch>'"
        )
    return worker_id, int(epoch)


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port); raises ValueError when malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {address!r} is not of the form 'host:port'")
    return host, int(port)


@dataclass(frozen=True)
class KVDescriptor:
    """Where a KV pool lives and how it is laid out. Serialized as JSON, never pickled."""

    descriptor_id: str
    worker_id: str
    epoch: int
    ucx_address: str  # "host:port" of the owner's KVReceiver
    layout: KVLayout

    def __post_init__(self) -> None:
        if parse_descriptor_id(self.descriptor_id) != (self.worker_id, self.epoch):
            raise DescriptorFormatError(
                f"descriptor id {self.descriptor_id!r} does not match worker "
                f"{self.worker_id!r} epoch {self.epoch}"
            )
        split_address(self.ucx_address)

    def to_json(self) -> str:
        return json.dumps(
            {
                "descriptor_id": self.descriptor_id,
                "worker_id": self.worker_id,
                "epoch": self.epoch,
                "ucx_address": self.ucx_address,
                "layout": self.layout.to_wire(),
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> KVDescriptor:
        try:
            data = json.loads(raw)
            return cls(
                descriptor_id=str(data["descriptor_id"]),
                worker_id=str(data["worker_id"]),
                epoch=int(data["epoch"]),
                ucx_address=str(data["ucx_address"]),
                layout=KVLayout.from_wire(data["layout"]),
            )
        except DescriptorFormatError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise DescriptorFormatError(f"malformed KV descriptor: {exc}") from exc
