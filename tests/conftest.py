"""Shared fixtures: the real default model, the transformers reference, real Redis."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from pdserve.rpc import core_env

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
# grpc in the test process runs as it does in pdserve's (before any test module imports it).
core_env.apply()

# Before any test module imports ucxx: kvxfer loads the library that binds UCX listeners to
# their configured host (kvxfer.listen), which only takes if it comes before libucxx.
import kvxfer  # noqa: E402, F401
from pdserve.control import WorkerRegistry  # noqa: E402
from tests.helpers.hang_report import pytest_runtest_call, watch_loop  # noqa: E402, F401
from tests.helpers.redis_server import redis_server  # noqa: E402, F401

# A module that starts processes (clusters, workers, redis-server, kubectl, compose's
# commands, mypy) is `slow`: `make test-fast` runs the rest (`-m "not slow"`).
_STARTS_PROCESSES = ("LocalCluster", "cluster_util", "subprocess", "Popen", "redis_server")
# In-process tests that take seconds each here (a GGUF conversion, a compiler killed mid-build,
# whole-engine runs against the transformers reference, schemathesis, generations of dozens of
# tokens on the real model, idle timeouts waited out): slow too. Prefixes of node ids;
# `pytest -m "not slow" --durations=20` shows what to add when `make test-fast` passes 2 min.
_SLOW_IN_PROCESS = (
    "test_model_store.py::test_gguf_path_converts_into_cache_with_identical_logits",
    "test_kernels.py::test_killed_build_does_not_block_later_loads",
    "test_engine_disagg.py::",
    "test_engine_reference.py::",
    "test_engine_sampling.py::",
    "test_structured_output.py::",
    "test_gateway_hostile.py::test_schemathesis",
    "test_resume.py::test_resume_through_remote_prefill",
    "test_resume.py::test_resume_continues_the_stream",
    # the ones that take `sync_ref` (greedy outputs of 7 prompts), and a 1,000-token prefill
    "test_async_engine.py::test_generate_streams_sync_engine_tokens",
    "test_async_engine.py::test_many_concurrent_generates",
    "test_async_engine.py::test_prefill_then_release",
    "test_async_engine.py::test_remote_prefill_copy_and_admit",
    "test_async_engine.py::test_event_loop_stays_responsive_during_prefill",
    "test_engine_errors.py::test_engine_rejects_bad_requests_and_keeps_serving",
    "test_engine_errors.py::test_prompt_larger_than_kv_pool",
    "test_engine_archs.py::test_greedy_generation_matches_batched",
    "test_sampling_processors.py::test_repetition_penalty_greedy_matches_transformers_generate",
    "test_sampling_processors.py::test_min_tokens_holds_eos_back",
    "test_sampling_processors.py::test_penalties_and_seeds_survive_remote_prefill",
    "test_kvxfer_bounds.py::test_idle_pinging_and_refused_peers_do_not_lock_out_a_prefill_worker",
    "test_kvxfer_bounds.py::test_authenticated_connections_idle_for_a_bounded_time",
    "test_kvxfer_bounds.py::test_unauthenticated_connections_must_keep_talking",
)


@pytest.fixture(scope="session", autouse=True)
async def _session_loop() -> None:
    """The session's event loop, for tests.helpers.hang_report."""
    watch_loop(asyncio.get_running_loop())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    verdicts: dict[Path, bool] = {}
    for item in items:
        path = Path(item.path)
        slow = verdicts.get(path)
        if slow is None:
            text = path.read_text(errors="replace")
            slow = verdicts[path] = path.parent.name == "faults" or any(
                word in text for word in _STARTS_PROCESSES)
        if slow or any(part in item.nodeid for part in _SLOW_IN_PROCESS):
            item.add_marker(pytest.mark.slow)

# Eight varied prompts; the last is over 1,000 tokens.
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a land far away, there lived a",
    "Translate to French: I would like a cup of coffee, please.",
    "1, 1, 2, 3, 5, 8, 13,",
    "Les élèves étudient la physique quantique à l'université parce que",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Summarize the following report.\n\n" + " ".join(
        f"In year {1900 + i} the town council of Riverton met {i % 7 + 2} times, approved "
        f"{i % 5 + 1} budgets and planted {i * 3 % 40 + 10} trees along the river."
        for i in range(40)) + "\n\nSummary:",
]
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from pdserve.engine.model_store import pull_default_model

    return pull_default_model(progress=False)


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):  # type: ignore[no-untyped-def]
    from pdserve.engine.tokenizer import Tokenizer

    return Tokenizer(model_dir)


@pytest.fixture(scope="session")
def prompt_ids(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    ids = [tokenizer.encode(p) for p in PROMPTS]
    assert max(len(i) for i in ids) > 1000
    return ids


@pytest.fixture(scope="session")
def loaded_model(model_dir: Path):  # type: ignore[no-untyped-def]
    from pdserve.engine.loader import load_model
    from pdserve.engine.model_store import model_id

    model, config = load_model(model_dir)
    return model, config, model_id(model_dir)


@pytest.fixture(scope="session")
def hf_reference(model_dir: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of transformers generate (fp32) on the same weights."""
    from tests.helpers.hf import hf_greedy

    return hf_greedy(model_dir, prompt_ids, MAX_NEW_TOKENS)


@pytest.fixture
def make_engine(loaded_model, tokenizer) -> Iterator:  # type: ignore[no-untyped-def]
    """Build LLMEngines sharing the loaded weights; checks every pool is fully free at the end."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    made: list[LLMEngine] = []

    def make(**kw):  # type: ignore[no-untyped-def]
        model, config, mid = loaded_model
        kw.setdefault("kv_cache_bytes", 256 << 20)
        eng = LLMEngine(model, config, EngineConfig(**kw), model_id=mid, tokenizer=tokenizer)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        assert eng.block_manager.num_free_blocks == eng.layout.num_blocks, "KV blocks leaked"


@pytest.fixture
def namespace() -> str:
    """A control-plane namespace of this test's own on the shared test Redis."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def registry(redis_server: str,  # noqa: F811 - the fixture imported above
                   namespace: str) -> AsyncIterator[WorkerRegistry]:
    async with WorkerRegistry.from_url(redis_server, namespace=namespace) as reg:
        yield reg
