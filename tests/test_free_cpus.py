"""An engine that shares its CPUs at a lower priority runs each step on a thread per CPU the
other processes leave free (pdserve.engine.free_cpus, `EngineConfig.adapt_threads`: `pdserve
cluster up`'s prefill workers), measured against a real process keeping a CPU busy."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import pytest
import torch

from pdserve.engine.free_cpus import (
    LONG_STEP_TOKENS,
    FreeCpus,
    busy_seconds,
    online_cpus,
    threads_for,
)
from pdserve.types import GenerateRequest
from tests.helpers.engine_util import greedy

CPUS = sorted(os.sched_getaffinity(0))
SETTLE_S = 5.0  # `FreeCpus.free` (a moving average over ~2 s) settles within this


@contextmanager
def busy_cpu(cpu: int) -> Iterator[None]:
    """Another process computing on `cpu` at this one's priority until the block ends."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(hog.pid, {cpu})
        yield
    finally:
        hog.kill()
        hog.wait(timeout=10)


def settled(free_cpus: FreeCpus, wait_s: float = SETTLE_S) -> float:
    time.sleep(wait_s)
    return free_cpus.free


def test_threads_for_the_free_cpus() -> None:
    assert [threads_for(f, 2) for f in (0.0, 0.5, 1.0, 1.4, 1.6, 2.0)] == [1, 1, 1, 1, 2, 2]
    assert threads_for(3.0, 2) == 2 and threads_for(0.0, 1) == 1


def test_busy_time_is_read_by_cpu_number() -> None:
    """psutil lists the online CPUs' times in order, without their numbers: with a CPU
    offline the list's index is not the CPU's number, so `busy_seconds` maps them by the
    online list."""
    online = online_cpus()
    assert online is not None and len(online) == len(psutil.cpu_times(percpu=True))
    assert set(os.sched_getaffinity(0)) <= set(online)
    total = busy_seconds(online)
    parts = [busy_seconds([cpu]) for cpu in online]
    assert 0.0 < sum(parts) and sum(parts) == pytest.approx(total, rel=0.01)
    assert busy_seconds([max(online) + 1]) == 0.0  # not a CPU here


def test_a_busy_neighbour_takes_its_cpu_and_this_process_takes_none() -> None:
    """A process computing on a CPU leaves none of it free; this process's own threads
    computing there do not count (they are what adapts)."""
    sampler = FreeCpus([CPUS[0]])
    try:
        with busy_cpu(CPUS[0]):
            assert settled(sampler, 0.5) > 0.4  # not yet a steady neighbour
            assert settled(sampler) < 0.4
        assert settled(sampler) > 0.6
    finally:
        sampler.close()
    everywhere = FreeCpus()
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        assert settled(everywhere) > len(CPUS) - 0.5
    finally:
        stop.set()
        spinner.join()
        everywhere.close()


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to leave one free")
def test_an_adapting_engine_steps_on_the_cpus_left_free_and_changes_no_token(
        make_engine, prompt_ids) -> None:  # type: ignore[no-untyped-def]
    """A short step (an interactive prompt) runs on one thread; a long one on two, but
    beside a process that has computed on one of its two CPUs for seconds, on one (and
    each publishes it: `EngineStats.threads`). The tokens are those of an engine that never
    adapts."""
    before = torch.get_num_threads()
    short, long = tuple(prompt_ids[0][:LONG_STEP_TOKENS // 2]), tuple(prompt_ids[-1])
    assert len(long) > 2 * LONG_STEP_TOKENS

    def run(engine, rid: str, prompt: tuple[int, ...]  # type: ignore[no-untyped-def]
            ) -> tuple[list[int | None], set[int]]:
        """The tokens, and the threads its steps ran on."""
        engine.add_request(GenerateRequest(rid, prompt, greedy(8)))
        got, threads = [], set()
        while engine.has_unfinished():
            got += [e.token_id for e in engine.step()]
            threads.add(engine.stats().threads)
        return got, threads

    try:
        fixed = make_engine(num_threads=2)
        want = {p: run(fixed, f"ref{len(p)}", p)[0] for p in (short, long)}
        engine = make_engine(num_threads=2, adapt_threads=True)
        try:
            assert run(engine, "s0", short) == (want[short], {1})
            assert run(engine, "l0", long) == (want[long], {2, 1})  # then decode steps
            with busy_cpu(CPUS[0]):
                time.sleep(SETTLE_S)
                assert run(engine, "l1", long) == (want[long], {1})
            time.sleep(SETTLE_S)
            assert run(engine, "l2", long) == (want[long], {2, 1})
        finally:
            engine.close()
    finally:
        torch.set_num_threads(before)
