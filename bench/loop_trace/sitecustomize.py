"""Long event-loop steps of a Python process started with this directory on PYTHONPATH
(bench only).

    PYTHONPATH=bench/loop_trace:. LOOP_TRACE_FILE=/tmp/steps.jsonl \\
        python -m bench.router_harness ...
    python -m bench.loop_trace.summarize /tmp/steps.jsonl --skip-s 40

In each process whose command line names `LOOP_TRACE_MATCH` (default "router"), every asyncio
callback (`asyncio.Handle._run`: a task's step, a timer, a reader) is timed, and each one
longer than `LOOP_TRACE_MIN_MS` (default 0.4) is appended to `LOOP_TRACE_FILE` as a JSON line
``[unix time, ms, what]`` (a task's name and its coroutine's qualified name), every 2 s and at
exit, with a ``["counts", unix time, callbacks, seconds in them]`` line. While one step runs,
nothing else on that loop does: a request that arrives then waits for it. The timing itself
costs each callback two clock reads.
"""

import json
import os
import sys
import time

_FILE = os.environ.get("LOOP_TRACE_FILE")

if _FILE and os.environ.get("LOOP_TRACE_MATCH", "router") in " ".join(sys.argv):
    import asyncio.events
    import atexit

    _MIN_S = float(os.environ.get("LOOP_TRACE_MIN_MS", "0.4")) / 1e3
    _run = asyncio.events.Handle._run
    _slow: list[tuple[float, float, str]] = []
    _totals = [0, 0.0, time.monotonic()]  # callbacks, seconds in them, last flush

    def _what(handle: asyncio.events.Handle) -> str:
        owner = getattr(handle._callback, "__self__", None)
        if isinstance(owner, asyncio.Task):
            coro = owner.get_coro()
            return f"task:{owner.get_name()}:{getattr(coro, '__qualname__', type(coro).__name__)}"
        return str(getattr(handle._callback, "__qualname__", type(handle._callback).__name__))

    def _flush() -> None:
        with open(_FILE, "a") as f:
            for row in _slow:
                f.write(json.dumps(row) + "\n")
            f.write(json.dumps(["counts", time.time(), _totals[0], round(_totals[1], 4)])
                    + "\n")
        _slow.clear()
        _totals[2] = time.monotonic()

    def _timed(self: asyncio.events.Handle) -> None:
        t0 = time.perf_counter()
        try:
            _run(self)
        finally:
            took = time.perf_counter() - t0
            _totals[0] += 1
            _totals[1] += took
            if took > _MIN_S:
                _slow.append((time.time(), round(took * 1e3, 3), _what(self)))
            if time.monotonic() - _totals[2] > 2.0:
                _flush()

    asyncio.events.Handle._run = _timed  # type: ignore[method-assign]
    atexit.register(_flush)
