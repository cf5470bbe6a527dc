"""The lifecycle every service shares (pdserve.service): what it does to the process."""

from __future__ import annotations

import gc

import pytest

from pdserve.service import NO_GC_FREEZE_ENV, freeze_startup_heap


def test_start_up_takes_its_heap_out_of_the_gcs_walks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before a service reports ready, what start-up allocated is frozen (full collections
    under load then walk only what came later); PDSERVE_NO_GC_FREEZE=1 leaves it alone."""
    gc.unfreeze()  # services started in-process by other tests froze this process too
    try:
        monkeypatch.setenv(NO_GC_FREEZE_ENV, "1")
        freeze_startup_heap()
        assert gc.get_freeze_count() == 0
        monkeypatch.delenv(NO_GC_FREEZE_ENV)
        freeze_startup_heap()
        assert gc.get_freeze_count() > 1000  # this process has imported torch, grpc, ...
        assert gc.get_count()[0] < 50  # collected first, so no garbage was frozen with it
    finally:
        gc.unfreeze()
