"""How grpc's C core runs in a pdserve process: environment variables it reads once, when
grpc is first imported, so they are set before that (`apply`, from `pdserve.cli.main`).

``GRPC_EXPERIMENTS=-event_engine_client,-event_engine_listener``: channels and listening
sockets on grpc's long-standing I/O manager. Their sockets are then polled by the thread that
already waits on grpc.aio's completion queue, not by EventEngine threads of their own, so
fewer threads wake and hand work on per call. A bare grpc.aio relay adds about a fifth less
latency and spends 12-18 % less CPU per request this way (`bench/grpc_relay_floor.py
--cores`); so does the router (docs/BENCHMARKS.md, "The router at scale").

An operator's own value of a variable wins (an empty one too): `apply` only fills in what is
unset.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

DEFAULTS: dict[str, str] = {
    "GRPC_EXPERIMENTS": "-event_engine_client,-event_engine_listener",
}


def apply(environ: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Fill in `DEFAULTS` that `environ` (the process's environment) does not set; returns
    it. Only takes effect in a process that has not imported grpc yet."""
    env = os.environ if environ is None else environ
    for name, value in DEFAULTS.items():
        env.setdefault(name, value)
    return env
