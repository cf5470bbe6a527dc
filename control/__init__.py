"""Control plane: worker leases, epochs and KV memory descriptors in Redis."""

from control.descriptors import (
    DescriptorFormatError,
    KVDescriptor,
    make_descriptor_id,
    parse_descriptor_id,
    split_address,
)
from control.directory import WorkerDirectory, WorkerEvent
from control.registry import ControlPlaneError, LoadFn, WorkerRegistry
from control.workers import ROLES, Role, WorkerInfo, WorkerInfoError

__all__ = [
    "ROLES",
    "ControlPlaneError",
    "DescriptorFormatError",
    "KVDescriptor",
    "LoadFn",
    "Role",
    "WorkerDirectory",
    "WorkerEvent",
    "WorkerInfo",
    "WorkerInfoError",
    "WorkerRegistry",
    "make_descriptor_id",
    "parse_descriptor_id",
    "split_address",
]
