"""Control plane: worker leases, epochs and KV memory descriptors in Redis."""

from pdserve.control.descriptors import (
    DescriptorFormatError,
    KVDescriptor,
    make_descriptor_id,
    parse_descriptor_id,
    split_address,
)
from pdserve.control.directory import WorkerDirectory, WorkerEvent
from pdserve.control.load import WorkerLoad, WorkerLoadError
from pdserve.control.registry import LoadFn, WorkerRegistry
from pdserve.control.workers import ROLES, Role, WorkerInfo, WorkerInfoError

__all__ = [
    "ROLES",
    "DescriptorFormatError",
    "KVDescriptor",
    "LoadFn",
    "Role",
    "WorkerDirectory",
    "WorkerEvent",
    "WorkerInfo",
    "WorkerInfoError",
    "WorkerLoad",
    "WorkerLoadError",
    "WorkerRegistry",
    "make_descriptor_id",
    "parse_descriptor_id",
    "split_address",
]
