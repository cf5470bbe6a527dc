"""Helpers for tests that run a real local cluster (separate processes on 127.0.0.1): the
module-scoped cluster fixture factory, `pdserve cluster up` as a child process, and gRPC
clients of the router and the workers."""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc
import pytest

from pdserve.cluster import LocalCluster
from pdserve.rpc import transport as gu
from pdserve.v1 import (
    common_pb2,
    decode_pb2_grpc,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)

ROUTE_NAMES = {common_pb2.PREFILL_ROUTE_LOCAL: "local", common_pb2.PREFILL_ROUTE_REMOTE: "remote",
               common_pb2.PREFILL_ROUTE_FALLBACK: "fallback"}


def cluster_fixture(*, kv_cache_mb: int, prefill: int = 1, decode: int = 1,
                    threads: int | None = 1, worker_args: tuple[str, ...] = (),
                    router_args: tuple[str, ...] = (), start_timeout_s: float = 300,
                    **options: Any) -> Any:
    """A module-scoped `cluster` fixture: a LocalCluster of the session's model (`model_dir`)
    with `prefill` and `decode` workers, started before the module's first test that asks for
    it and closed after its last. Assign it in the test module, ``cluster = cluster_fixture(
    ...)``: each module gets a cluster of its own, nothing is shared across modules.

    Every worker gets ``--threads THREADS`` (none if None), ``--kv-cache-mb KV_CACHE_MB`` and
    `worker_args`; the router gets `router_args`; `options` go to LocalCluster as they are
    (`cluster_secret`, `tls`, `env`, ...). `start_timeout_s` bounds the start, all of it."""
    threads_args = ("--threads", str(threads)) if threads is not None else ()
    # PDSERVE_TEST_DATA_PLANE=compiled: every such cluster's router serves its gRPC API with
    # the compiled data plane (router.dataplane), to run these tests against it.
    if plane := os.environ.get("PDSERVE_TEST_DATA_PLANE"):
        router_args = (*router_args, "--data-plane", plane)
    extra_worker_args = (*threads_args, "--kv-cache-mb", str(kv_cache_mb), *worker_args)

    @pytest.fixture(scope="module")
    def cluster(model_dir: Path) -> Iterator[LocalCluster]:
        c = LocalCluster(prefill=prefill, decode=decode, model=str(model_dir),
                         extra_worker_args=extra_worker_args, router_args=router_args,
                         **options)
        try:
            yield c.start(timeout_s=start_timeout_s)
        finally:
            c.close()

    return cluster


class ClusterUp:
    """`pdserve cluster up` (``argv``) as a user starts it, in a child process whose stderr is
    read line by line on a thread (and closed at its end). ``wait_ready`` returns its
    ``ready:`` line; ``seen`` holds every line read until then."""

    def __init__(self, argv: list[str], env: Mapping[str, str] | None = None, *,
                 start_new_session: bool = False):
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     text=True, env=env, start_new_session=start_new_session)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        assert self.proc.stderr is not None
        threading.Thread(target=self._read, args=(self.proc.stderr,), daemon=True).start()

    def _read(self, stderr: IO[str]) -> None:
        with stderr:
            for line in stderr:
                self.lines.put(line)

    def wait_ready(self, timeout_s: float) -> str:
        """The ``ready:`` line; fails the test (killing the process) if it exits first or
        the line is not out within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not any(line.startswith("ready:") for line in self.seen):
            try:
                self.seen.append(self.lines.get(timeout=1))
            except queue.Empty:
                if (self.proc.poll() is not None and self.lines.empty()) \
                        or time.monotonic() > deadline:
                    if self.proc.poll() is None:
                        self.proc.kill()
                    pytest.fail(f"cluster up never got ready: {''.join(self.seen)}")
        return next(line for line in self.seen if line.startswith("ready:"))


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    route: str = ""
    decode_worker: str = ""
    prefill_worker: str = ""
    finish_reason: int = 0
    cached_tokens: int = 0
    timings: common_pb2.StageTimings | None = None
    ttft_s: float | None = None  # measured here: sending the request -> first token
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)


async def generate(address: str, ids: list[int], max_tokens: int = 32, *,
                   request_id: str = "", latency: str = "standard",
                   deadline_s: float = 300, logprobs: int | None = None) -> Result:
    lat = {"interactive": common_pb2.LATENCY_CLASS_INTERACTIVE,
           "standard": common_pb2.LATENCY_CLASS_STANDARD,
           "batch": common_pb2.LATENCY_CLASS_BATCH}[latency]
    async with gu.insecure_channel(address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        req = router_pb2.GenerateRequest(
            request_id=request_id, token_ids=router_pb2.TokenIds(ids=ids),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                               logprobs=logprobs),
            latency_class=lat, return_timings=True)
        out = Result()
        await ch.channel_ready()  # the client's TTFT leaves out connecting
        started = time.monotonic()
        async for resp in stub.Generate(req, timeout=deadline_s):
            if out.ttft_s is None and resp.token_ids:
                out.ttft_s = time.monotonic() - started
            out.tokens.extend(resp.token_ids)
            out.logprobs.extend(resp.logprobs)
            out.text += resp.text
            out.route = ROUTE_NAMES.get(resp.route, out.route)
            out.decode_worker = resp.decode_worker or out.decode_worker
            out.prefill_worker = resp.prefill_worker or out.prefill_worker
            out.cached_tokens = resp.usage.cached_tokens
            if resp.finish_reason:
                out.finish_reason = resp.finish_reason
                out.timings = resp.timings
        return out


class Stream:
    """One streamed greedy request with `ignore_eos` through the router: its tokens as they
    arrive (and when), how it ended, the error if it failed (recorded, not raised)."""

    def __init__(self, ids: list[int], max_tokens: int = 64):
        self.ids, self.max_tokens = ids, max_tokens
        self.tokens: list[int] = []
        self.arrivals: list[float] = []  # time.monotonic() of each token
        self.text = ""
        self.finish_reason = 0
        self.error: BaseException | None = None
        self.decode_worker = ""
        self.route = 0

    async def run(self, address: str, timeout_s: float = 300) -> None:
        try:
            async with gu.insecure_channel(address) as ch:
                stub = router_pb2_grpc.RouterStub(ch)
                req = router_pb2.GenerateRequest(
                    token_ids=router_pb2.TokenIds(ids=self.ids),
                    sampling=common_pb2.SamplingParams(max_tokens=self.max_tokens,
                                                       temperature=0.0, ignore_eos=True))
                async for resp in stub.Generate(req, timeout=timeout_s):
                    self.tokens.extend(resp.token_ids)
                    self.arrivals.extend([time.monotonic()] * len(resp.token_ids))
                    self.text += resp.text
                    self.decode_worker = resp.decode_worker or self.decode_worker
                    self.route = resp.route or self.route
                    if resp.finish_reason:
                        self.finish_reason = resp.finish_reason
        except Exception as exc:  # recorded and asserted on
            self.error = exc

    def longest_gap(self) -> float:
        """The longest wait between two tokens (0 with fewer than two)."""
        return max((b - a for a, b in itertools.pairwise(self.arrivals)), default=0.0)


async def start_streams(address: str, prompts: list[list[int]], max_tokens: int = 64, *,
                        min_tokens: int = 3, timeout_s: float = 240,
                        ) -> tuple[list[Stream], list[asyncio.Task[None]]]:
    """Start one Stream per prompt and return once each has `min_tokens` (mid-stream)."""
    streams = [Stream(list(ids), max_tokens) for ids in prompts]
    tasks = [asyncio.create_task(s.run(address)) for s in streams]
    deadline = time.monotonic() + timeout_s
    while min(len(s.tokens) for s in streams) < min_tokens:
        assert time.monotonic() < deadline, [len(s.tokens) for s in streams]
        assert not any(s.error for s in streams), [s.error for s in streams]
        await asyncio.sleep(0.02)
    return streams, tasks


async def worker_stats(address: str, role: str) -> Any:
    """A worker's Stats reply (decode_pb2.DecodeStats or prefill_pb2.PrefillStats)."""
    async with gu.insecure_channel(address) as ch:
        stub = (decode_pb2_grpc.DecodeWorkerStub(ch) if role == "decode"
                else prefill_pb2_grpc.PrefillWorkerStub(ch))
        return await stub.Stats(common_pb2.StatsRequest(), timeout=10)


async def decode_stats(address: str) -> Any:
    return await worker_stats(address, "decode")


async def prefill_stats(address: str) -> Any:
    return await worker_stats(address, "prefill")


async def worker_blocks(address: str, role: str) -> tuple[int, int]:
    """(free, total) KV blocks of a worker."""
    s = await worker_stats(address, role)
    return s.num_free_blocks, s.num_total_blocks


async def wait_blocks_free(address: str, role: str, timeout_s: float = 20) -> tuple[int, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        free, total = await worker_blocks(address, role)
        if free == total or time.monotonic() > deadline:
            return free, total
        await asyncio.sleep(0.2)


def is_unavailable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE
