"""The worker record each prefill/decode worker keeps alive in the control plane."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pdserve.control.descriptors import split_address
from pdserve.control.load import WorkerLoad, WorkerLoadError

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")


class WorkerInfoError(ValueError):
    """A worker record is malformed."""


@dataclass(frozen=True)
class WorkerInfo:
    """One worker incarnation as the router sees it.

    `epoch` comes from `WorkerRegistry.next_epoch` and grows on every restart; a record with a
    higher epoch supersedes a lower one for the same `worker_id`. `load` is refreshed by the
    heartbeat (a mapping given here is read with `WorkerLoad.from_dict`).
    """

    worker_id: str
    role: Role
    grpc_address: str
    model_id: str
    epoch: int
    started_at: float  # time.time() of the worker's start
    ucx_address: str = ""
    descriptor_id: str = ""
    load: WorkerLoad = field(default_factory=WorkerLoad)
    # Where it computes, for placement to price sharing (`shares_cpus`), never for trust: an
    # opaque id of its host ("" unknown: `this_host`) and the CPUs it may run on (() unknown).
    host_id: str = ""
    cpus: tuple[int, ...] = ()
    # Its nice value (`this_nice`): how much of a shared CPU it takes from a worker at
    # another priority (`stall_share`).
    nice: int = 0
    # Its engine's torch threads (0: unknown, one per CPU of `cpus`), and whether it runs
    # each step on fewer, by the CPUs others leave free (`EngineConfig.adapt_threads`): what
    # the router scales its measured prefill rate by (router.cost.cpu_factor).
    threads: int = 0
    adapt_threads: bool = False

    def __post_init__(self) -> None:
        if not self.worker_id or any(c.isspace() for c in self.worker_id):
            raise WorkerInfoError(f"worker_id must be non-empty without spaces: {self.worker_id!r}")
        if self.role not in ROLES:
            raise WorkerInfoError(f"role must be one of {ROLES}, got {self.role!r}")
        for name in ("grpc_address", "ucx_address"):
            value = getattr(self, name)
            if name == "ucx_address" and value == "":
                continue
            try:
                split_address(value)
            except ValueError as exc:
                raise WorkerInfoError(f"{name}: {exc}") from None
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 0:
            raise WorkerInfoError(f"epoch must be an integer >= 0, got {self.epoch!r}")
        if not isinstance(self.host_id, str) or len(self.host_id) > 64 \
                or any(c.isspace() for c in self.host_id):
            raise WorkerInfoError("host_id must be a string of at most 64 characters without "
                                  "spaces")
        cpus = self.cpus
        if not isinstance(cpus, (list, tuple)) or len(cpus) > MAX_CPUS or any(
                isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < MAX_CPUS
                for c in cpus):
            raise WorkerInfoError(f"cpus must be at most {MAX_CPUS} CPU numbers below "
                                  f"{MAX_CPUS}")
        object.__setattr__(self, "cpus", tuple(sorted(set(cpus))))
        if isinstance(self.nice, bool) or not isinstance(self.nice, int) \
                or not -20 <= self.nice <= 19:
            raise WorkerInfoError(f"nice must be an integer from -20 to 19, got {self.nice!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) \
                or not 0 <= self.threads <= MAX_CPUS:
            raise WorkerInfoError(f"threads must be an integer from 0 to {MAX_CPUS}, got "
                                  f"{self.threads!r}")
        if not isinstance(self.adapt_threads, bool):
            raise WorkerInfoError(f"adapt_threads must be a boolean, got {self.adapt_threads!r}")
        try:
            object.__setattr__(self, "load", WorkerLoad.from_dict(self.load))
        except (WorkerLoadError, TypeError) as exc:
            raise WorkerInfoError(f"load: {exc}") from None

    def shares_cpus(self, other: WorkerInfo) -> bool:
        """Whether the two compete for CPUs: the same host, and CPU sets that overlap (or
        either unknown). Unknown hosts share nothing."""
        return (bool(self.host_id) and self.host_id == other.host_id
                and (not self.cpus or not other.cpus
                     or not set(self.cpus).isdisjoint(other.cpus)))

    def cpus_shared(self, other: WorkerInfo) -> int:
        """How many of this worker's CPUs `other` computes on when busy: the CPUs both may
        run on (one where either set is unknown); 0 where they do not share (`shares_cpus`)."""
        if not self.shares_cpus(other):
            return 0
        if not self.cpus or not other.cpus:
            return 1
        return len(set(self.cpus) & set(other.cpus))

    def stall_share(self, other: WorkerInfo) -> float:
        """How much `other`'s work is slowed per second of CPU this worker computes: 0 where
        they do not share CPUs (`shares_cpus`); else the scheduler's weight of this worker's
        nice value over `other`'s (Linux CFS: each nice step is 1.25x the weight), at most 1.
        A prefill worker at nice 5 beside a decode worker at nice 0 takes a quarter of a CPU
        both want, so the decode steps it meets take 1.33x as long, not a whole prefill
        chunk longer (`pdserve cluster up --prefill 1 --decode 2`, docs/BENCHMARKS.md)."""
        if not self.shares_cpus(other):
            return 0.0
        return min(1.0, 1.25 ** (other.nice - self.nice))

    def cpu_share_beside(self, other: WorkerInfo) -> float:
        """The share of a CPU this worker gets where `other`, busy, wants it too: the two
        scheduler weights' (1.25x a nice step), so a prefill worker at nice 5 beside a decode
        worker at nice 0 gets a quarter; 1 where they do not share CPUs (`shares_cpus`)."""
        if not self.shares_cpus(other):
            return 1.0
        return 1.0 / (1.0 + 1.25 ** (self.nice - other.nice))

    def with_load(self, load: WorkerLoad | Mapping[str, float]) -> WorkerInfo:
        return WorkerInfo(**{**self._fields(), "load": WorkerLoad.from_dict(load)})

    def to_json(self) -> str:
        return json.dumps({**self._fields(), "load": self.load.to_dict()}, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> WorkerInfo:
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise WorkerInfoError(f"malformed worker record: {exc}") from exc
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: object) -> WorkerInfo:
        """A record's decoded JSON; WorkerInfoError if it is not a worker record."""
        try:
            if not isinstance(data, dict):
                raise WorkerInfoError("worker record must be a JSON object")
            known = {k: data[k] for k in _FIELDS if k in data}  # newer writers may add fields
            known["load"] = WorkerLoad.from_dict(known.get("load"))
            return cls(**known)
        except WorkerInfoError:
            raise
        except (ValueError, TypeError) as exc:
            raise WorkerInfoError(f"malformed worker record: {exc}") from exc

    def _fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _FIELDS}


_FIELDS = (
    "worker_id",
    "role",
    "grpc_address",
    "model_id",
    "epoch",
    "started_at",
    "ucx_address",
    "descriptor_id",
    "load",
    "host_id",
    "cpus",
    "nice",
    "threads",
    "adapt_threads",
)
MAX_CPUS = 4096


def this_nice() -> int:
    """This process's nice value (what `--nice` raised it to)."""
    return os.getpriority(os.PRIO_PROCESS, 0)


def boot_id() -> str | None:
    """This kernel's boot id: equal for every process (and container) on one running
    kernel, so on two ends only on the same host (None: unknown). kvxfer's same-host paths
    offer it as is; worker records carry `this_host`'s digest of it."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def this_host() -> str:
    """This host's id for `WorkerInfo.host_id`: a digest of `boot_id` ("" where none)."""
    boot = boot_id()
    return hashlib.blake2b(boot.encode(), digest_size=8, person=b"pdserve-host").hexdigest() \
        if boot else ""


def this_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on (its affinity), for `WorkerInfo.cpus`."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))[:MAX_CPUS]
    except (AttributeError, OSError):
        return ()
