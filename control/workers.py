"""The worker record each prefill/decode worker keeps alive in the control plane."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from control.descriptors import split_address

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")


class WorkerInfoError(ValueError):
    """A worker record is malformed."""


@dataclass(frozen=True)
class WorkerInfo:
    """One worker incarnation as the router sees it.

    `epoch` comes from `WorkerRegistry.next_epoch` and grows on every restart; a record with a
    higher epoch supersedes a lower one for the same `worker_id`. `load` holds plain numbers
    (running, waiting, free_blocks, backlog, ...) refreshed by the heartbeat.
    """

    worker_id: str
    role: Role
    grpc_address: str
    model_id: str
    epoch: int
    started_at: float  # time.time() of the worker's start
    ucx_address: str = ""
    descriptor_id: str = ""
    load: dict[str, float] = field(default_factory=dict)

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
        for key, value in self.load.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise WorkerInfoError(f"load[{key!r}] must be a number, got {value!r}")
            if not math.isfinite(value):
                raise WorkerInfoError(f"load[{key!r}] must be finite, got {value!r}")

    def with_load(self, load: dict[str, float]) -> WorkerInfo:
        return WorkerInfo(**{**self._fields(), "load": dict(load)})

    def to_json(self) -> str:
        return json.dumps(self._fields(), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> WorkerInfo:
        try:
            data = json.loads(raw)
            if not isinstance(data, dict):
                raise WorkerInfoError("worker record must be a JSON object")
            known = {k: data[k] for k in _FIELDS if k in data}  # newer writers may add fields
            known["load"] = dict(known.get("load") or {})
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
)
