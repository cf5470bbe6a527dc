"""How long ucxx's UCX progress thread sleeps between wake-ups when nothing happens.

ucxx's default "thread" progress mode starts one progress thread per worker that waits on
UCX's event fd with a 1 ms timeout (`ThreadMode`: `start_progress_thread(epoll_timeout=1)`),
so every idle worker process wakes ~1,700 times a second (docs/BENCHMARKS.md,
idle_worker_wakeups) and takes slices from the engine's compute threads on a small machine.
The timeout is only a backstop: UCX arms the event fd for network events, and ucxx signals
it when a request is queued for the thread (delayed submission), so the thread wakes for
work at once either way. `install` starts the thread with `PDSERVE_UCX_EPOLL_TIMEOUT_MS`
(default 100; 1 is ucxx's own) instead. It must run before the first UCX endpoint or
listener of the process (importing `kvxfer` does it).

ucxx's thread also runs a start callback that makes a CUDA context current on device 0. On a
host without a CUDA device that callback imports cuda.core and NVML (~16 MB of RSS per
process, after the worker is ready) only to fail looking for the driver, so the thread here
runs it only where torch sees a CUDA device.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

DEFAULT_EPOLL_TIMEOUT_MS = 100
ENV = "PDSERVE_UCX_EPOLL_TIMEOUT_MS"

_installed: int | None = None


def epoll_timeout_ms() -> int:
    """The progress thread's epoll timeout in ms: $PDSERVE_UCX_EPOLL_TIMEOUT_MS or 100."""
    raw = os.environ.get(ENV, "")
    try:
        value = int(raw) if raw else DEFAULT_EPOLL_TIMEOUT_MS
    except ValueError:
        raise ValueError(f"{ENV} must be a whole number of ms, not {raw!r}") from None
    if value < 1:
        raise ValueError(f"{ENV} must be >= 1 ms, not {value}")
    return value


def needs_cuda_context() -> bool:
    """Whether the progress thread should make a CUDA context current (a CUDA device exists)."""
    import torch

    return bool(torch.cuda.is_available())


def install() -> int | None:
    """Make ucxx start its progress threads with `epoll_timeout_ms()`; the timeout in force,
    or None where this ucxx has no `ThreadMode` to replace (its own 1 ms then applies)."""
    global _installed
    if _installed is not None:
        return _installed
    try:
        from ucxx._lib_async import application_context, continuous_ucx_progress
    except ImportError:
        return None
    base = getattr(application_context, "ThreadMode", None)
    if base is None or not hasattr(continuous_ucx_progress, "ProgressTask"):
        return None
    timeout_ms = epoll_timeout_ms()
    create_context = (getattr(continuous_ucx_progress, "_create_context", None)
                      if needs_cuda_context() else None)

    class ThreadMode(continuous_ucx_progress.ProgressTask):
        """ucxx's ThreadMode, with our epoll timeout."""

        def __init__(self, worker: Any, event_loop: Any, polling_mode: bool = False) -> None:
            super().__init__(worker, event_loop)
            if create_context is not None:
                worker.set_progress_thread_start_callback(create_context)
            worker.start_progress_thread(polling_mode=polling_mode, epoll_timeout=timeout_ms)
            weakref.finalize(self, worker.stop_progress_thread)

    application_context.ThreadMode = ThreadMode
    _installed = timeout_ms
    return timeout_ms
