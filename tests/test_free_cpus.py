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

import pytest
import torch

from pdserve.engine.free_cpus import FreeCpus, threads_for
from pdserve.types import GenerateRequest
from tests.helpers.engine_util import greedy, run_to_end

CPUS = sorted(os.sched_getaffinity(0))
SETTLE_S = 1.0  # the sampler's moving average settles within a fraction of this


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


def settled(free_cpus: FreeCpus) -> float:
    time.sleep(SETTLE_S)
    return free_cpus.free


def test_threads_for_the_free_cpus() -> None:
    assert [threads_for(f, 2) for f in (0.0, 0.5, 1.0, 1.4, 1.6, 2.0)] == [1, 1, 1, 1, 2, 2]
    assert threads_for(3.0, 2) == 2 and threads_for(0.0, 1) == 1


def test_a_busy_neighbour_takes_its_cpu_and_this_process_takes_none() -> None:
    """A process computing on a CPU leaves none of it free; this process's own threads
    computing there do not count (they are what adapts)."""
    sampler = FreeCpus([CPUS[0]], period_s=0.05)
    try:
        with busy_cpu(CPUS[0]):
            assert settled(sampler) < 0.4
        assert settled(sampler) > 0.6
    finally:
        sampler.close()
    everywhere = FreeCpus(period_s=0.05)
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
    """Beside a process computing on one of its two CPUs, a step runs on one thread (and
    publishes it: `EngineStats.threads`); with both free, on two. The tokens are those of
    an engine that never adapts."""
    before = torch.get_num_threads()
    prompt = tuple(prompt_ids[-1])
    try:
        fixed = make_engine(num_threads=2)
        want = run_to_end(fixed, [GenerateRequest("ref", prompt, greedy(8))])["ref"]
        engine = make_engine(num_threads=2, adapt_threads=True)
        try:
            with busy_cpu(CPUS[0]):
                time.sleep(SETTLE_S)
                got = run_to_end(engine, [GenerateRequest("a", prompt, greedy(8))])["a"]
                assert engine.stats().threads == 1
            assert [e.token_id for e in got] == [e.token_id for e in want]
            time.sleep(SETTLE_S)
            again = run_to_end(engine, [GenerateRequest("b", prompt, greedy(8))])["b"]
            assert engine.stats().threads == 2
            assert [e.token_id for e in again] == [e.token_id for e in want]
        finally:
            engine.close()
    finally:
        torch.set_num_threads(before)
