"""ucxx's progress thread starts with our epoll timeout (kvxfer.progress): idle workers wake
~10x a second instead of ~1,700 (the real transfers over it: tests/test_kvxfer.py)."""

from __future__ import annotations

import pytest

import kvxfer  # noqa: F401 (installs it)
from kvxfer import progress


def test_importing_kvxfer_replaces_ucxx_thread_mode() -> None:
    from ucxx._lib_async import application_context

    assert progress.install() == progress.epoll_timeout_ms() == 100
    assert application_context.ThreadMode.__module__ == "kvxfer.progress"


@pytest.mark.parametrize("raw", ["0", "-5", "1.5", "soon"])
def test_a_bad_timeout_is_refused(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(progress.ENV, raw)
    with pytest.raises(ValueError, match=progress.ENV):
        progress.epoll_timeout_ms()


def test_the_timeout_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(progress.ENV, "1")
    assert progress.epoll_timeout_ms() == 1


def test_no_cuda_context_is_made_without_a_cuda_device() -> None:
    """On a CPU-only host the progress thread does not import cuda.core to fail at finding a
    driver (it used to, costing each worker ~16 MB of RSS after it was ready)."""
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the context is wanted")
    code = ("import asyncio, sys, kvxfer.listen\n"
            "async def main():\n"
            "    listener = kvxfer.listen.create_listener(lambda ep: None, host='127.0.0.1')\n"
            "    await asyncio.sleep(0.5)\n"
            "    listener.close()\n"
            "asyncio.run(main())\n"
            "print(sorted(m for m in sys.modules if m.startswith('cuda.core')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
