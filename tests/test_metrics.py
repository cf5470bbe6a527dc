"""Prometheus metrics of a live 1P1D cluster against the shipped Grafana dashboard.

Every metric name the dashboard's PromQL queries must be served by the router or a worker,
every sample carries `model_name`, the router repeats each worker's engine gauges, and
/metrics answers without an API key while the API itself wants one. The scrape config and
Grafana provisioning files are checked for the paths and targets compose relies on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from pdserve.aio import TimeSlice
from pdserve.cluster import LocalCluster
from pdserve.engine.metrics import (
    ENGINE_METRICS,
    WorkerLoadCollector,
    engine_load,
    exposition,
    labelled_registry,
)
from pdserve.engine.stats import DurationHistogram, EngineStats
from tests.helpers.cluster_util import cluster_fixture

ROOT = Path(__file__).resolve().parents[1]
OBS = ROOT / "deploy" / "observability"
DASHBOARD = OBS / "grafana" / "dashboards" / "pdserve.json"
KEY = "metrics-test-key"
REMOTE_THRESHOLD = 64
pytestmark = pytest.mark.timeout(900)

# Counted only when something goes wrong: declared on the page, no sample after clean traffic.
EVENT_ONLY = frozenset({"pdserve_router_fallbacks_total", "pdserve_router_decode_retries_total",
                        "pdserve_prefill_kv_transfer_failures_total",
                        "pdserve_decode_fenced_transfers_total"})
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
             "gauge": ("",), "summary": ("_sum", "_count")}
_NAME = re.compile(r"\bpdserve[:_][A-Za-z0-9_:]*")


# --------------------------------------------------------------------------- helpers


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v.get("definition")]
    return exprs


def queried_names() -> set[str]:
    return {name for expr in dashboard_queries() for name in _NAME.findall(expr)}


class Page:
    """One /metrics page: sample names a query may use (declared families) and samples."""

    def __init__(self, text: str):
        self.declared: set[str] = set()
        self.samples: list[tuple[str, dict[str, str], float]] = []
        for fam in text_string_to_metric_families(text):
            self.declared.update(fam.name + s for s in _SUFFIXES.get(fam.type, ("",)))
            self.samples += [(s.name, s.labels, s.value) for s in fam.samples
                             if not s.name.endswith("_created")]

    def value(self, name: str, **labels: str) -> float:
        return sum(v for n, lab, v in self.samples
                   if n == name and all(lab.get(k) == want for k, want in labels.items()))

    def has(self, name: str, **labels: str) -> bool:
        return any(n == name and all(lab.get(k) == want for k, want in labels.items())
                   for n, lab, _ in self.samples)


def scrape(url: str, headers: dict[str, str] | None = None) -> Page:
    r = httpx.get(url, timeout=10, headers=headers or {})
    assert r.status_code == 200, (url, r.status_code, r.text[:200])
    assert r.headers["content-type"].startswith("text/plain")
    return Page(r.text)


# --------------------------------------------------------------------------- offline


def test_dashboard_is_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["targets"] and all(t["expr"] for t in p["targets"]), p["title"]
            assert p["datasource"]["uid"] == "pdserve-prometheus"
    for expr in dashboard_queries():
        assert expr.count("(") == expr.count(")"), expr
        assert expr.count("{") == expr.count("}"), expr
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("time to first token", "inter-token", "end-to-end", "throughput", "running",
                  "waiting", "kv cache usage", "prefix cache hit rate", "routing", "fallback",
                  "kv transfer"):
        assert topic in titles, topic


def test_prometheus_and_grafana_provisioning() -> None:
    prom = yaml.safe_load((OBS / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert jobs["pdserve-router"]["static_configs"][0]["targets"] == ["router:8000"]
    for role in ("prefill", "decode"):
        sd = jobs[f"pdserve-{role}"]["dns_sd_configs"][0]
        assert sd["names"] == [role] and sd["port"] == 9100  # compose service, --metrics-port
    ds = yaml.safe_load((OBS / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uids = {d["uid"] for d in ds["datasources"]}
    assert "pdserve-prometheus" in uids
    prov = yaml.safe_load((OBS / "grafana/provisioning/dashboards/pdserve.yml").read_text())
    assert prov["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_router_collector_reads_worker_load() -> None:
    queue = DurationHistogram((0.5, 1.0))
    queue.observe(0.7)
    stats = EngineStats(running=2, waiting=1, awaiting_kv=0, held=0, free_blocks=30,
                        total_blocks=40, prefix_cache_hit_rate=0.25, steps=9, preemptions=1,
                        prefix_cache_queries=400, prefix_cache_hits=100,
                        queue_time=queue.snapshot())
    assert stats.queue_time.count == 1 and stats.queue_time.counts == (0, 1, 1)
    load = engine_load(stats)
    reg = CollectorRegistry()
    reg.register(WorkerLoadCollector(lambda: [("decode-0", "decode", load)]))
    got = {m.name: m.samples[0] for m in reg.collect()}
    assert len(got) == len(ENGINE_METRICS)
    assert got["pdserve:kv_cache_usage_perc"].value == pytest.approx(0.25)
    assert got["pdserve:prefix_cache_hits"].value == 100
    assert got["pdserve:num_requests_running"].labels == {"worker": "decode-0", "role": "decode"}


@contextlib.asynccontextmanager
async def loop_steps() -> AsyncIterator[list[int]]:
    """The event loop's steps while held, counted by a task that ticks once a step."""
    count = [0]

    async def tick() -> None:
        while True:
            count[0] += 1
            await asyncio.sleep(0)

    task = asyncio.ensure_future(tick())
    await asyncio.sleep(0)
    try:
        yield count
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_time_slice_yields_once_its_budget_has_run() -> None:
    """`pdserve.aio.TimeSlice` (the metrics page renders through it) lets the loop's other
    tasks run only once its budget has run since the pass began or last yielded (a huge
    budget: never; none: after every item)."""
    async with loop_steps() as steps:
        start, never = steps[0], TimeSlice(3600.0)
        for _ in range(50):
            await never.step()
        assert steps[0] == start
        always = TimeSlice(0.0)
        for _ in range(50):
            await always.step()
        assert steps[0] - start >= 49


async def test_the_page_rendered_in_steps_is_generate_latests() -> None:
    """`exposition` yields to the event loop between families and renders the very bytes
    `generate_latest` does: counters, a histogram, labelled and worker-load families."""
    inner = CollectorRegistry()
    Counter("pdserve_test_total", "a counter", ["kind"], registry=inner).labels("a").inc(3)
    Histogram("pdserve_test_seconds", "a histogram", buckets=(0.1, 1.0),
              registry=inner).observe(0.5)
    load = {"running": 2, "waiting": 1, "free_blocks": 30, "total_blocks": 40}
    inner.register(WorkerLoadCollector(lambda: [(f"decode-{i}", "decode", load)
                                                 for i in range(64)]))
    page = labelled_registry(inner, model_name="m")
    async with loop_steps() as steps:
        got = await exposition(page, budget_s=0.0)  # no budget: a step per family
    assert got == generate_latest(page)
    assert steps[0] >= len(list(page.collect()))  # it let the loop run between families


# --------------------------------------------------------------------------- live cluster


cluster = cluster_fixture(kv_cache_mb=192,
                          router_args=("--placement", "threshold",
                                       "--remote-threshold", str(REMOTE_THRESHOLD),
                                       "--api-key", KEY))


@dataclass
class Scrapes:
    model: str  # the served model name every sample must carry
    pages: dict[str, Page]  # by process: router, decode-0, prefill-0


@pytest.fixture(scope="module")
def scrapes(cluster: LocalCluster, prompt_ids: list[list[int]]) -> Scrapes:
    """Scrapes of every process after one local and one remote request."""
    auth = {"Authorization": f"Bearer {KEY}"}
    model = httpx.get(f"{cluster.http_url}/v1/models", headers=auth,
                      timeout=10).json()["data"][0]["id"]
    short: list[int] = min(prompt_ids, key=len)
    longer = [p for p in prompt_ids if len(p) > REMOTE_THRESHOLD]
    long = min(longer, key=len).copy()
    long[1] = 1234  # nothing of it is cached anywhere: prefilled remotely
    assert len(short) < REMOTE_THRESHOLD
    for prompt in (short, long):
        r = httpx.post(f"{cluster.http_url}/v1/completions", headers=auth, timeout=300,
                       json={"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
    urls = {"router": f"{cluster.http_url}/metrics",
            "decode-0": cluster.metrics_url("decode-0"),
            "prefill-0": cluster.metrics_url("prefill-0")}
    # The router's engine gauges come from the workers' heartbeats: wait for ones carrying
    # the requests' prefix-cache lookups.
    deadline = time.monotonic() + 30
    while True:
        pages = {name: scrape(url) for name, url in urls.items()}  # no API key sent
        router = pages["router"]
        if time.monotonic() > deadline or all(
                router.value("pdserve:prefix_cache_queries_total", worker=w) > 0
                for w in ("decode-0", "prefill-0")):
            return Scrapes(model, pages)
        time.sleep(0.5)


def test_metrics_page_needs_no_api_key(cluster: LocalCluster, scrapes: Scrapes) -> None:
    assert httpx.get(f"{cluster.http_url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{cluster.http_url}/metrics", timeout=10).status_code == 200


def test_every_dashboard_metric_is_served(scrapes: Scrapes) -> None:
    served = set().union(*(p.declared for p in scrapes.pages.values()))
    sampled = {n for p in scrapes.pages.values() for n, _, _ in p.samples}
    wanted = queried_names()
    assert len(wanted) > 20
    assert not wanted - served, f"queried by the dashboard, served nowhere: {wanted - served}"
    empty = wanted - sampled - EVENT_ONLY
    assert not empty, f"no samples after a local and a remote request: {empty}"


def test_every_sample_carries_model_name(scrapes: Scrapes) -> None:
    for process, page in scrapes.pages.items():
        assert page.samples, process
        for name, labels, _ in page.samples:
            assert labels.get("model_name") == scrapes.model, (process, name, labels)


def test_router_shows_every_worker_engine(scrapes: Scrapes) -> None:
    pages = scrapes.pages
    router = pages["router"]
    for worker, role in (("decode-0", "decode"), ("prefill-0", "prefill")):
        for m in ENGINE_METRICS:
            name = m.name + ("_total" if m.kind == "counter" else "")
            assert router.has(name, worker=worker, role=role), (name, worker)
        usage = router.value("pdserve:kv_cache_usage_perc", worker=worker)
        assert 0.0 <= usage <= 1.0
    assert router.value("pdserve:prefix_cache_queries_total", worker="decode-0") > 0
    # The same gauge on the worker's own port, with the same labels.
    decode = pages["decode-0"]
    assert decode.has("pdserve:num_requests_running", worker="decode-0", role="decode")
    assert decode.value("pdserve:request_queue_time_seconds_count", worker="decode-0") >= 1
    assert pages["prefill-0"].value("pdserve:request_queue_time_seconds_count") >= 1


def test_request_metrics_follow_the_requests(scrapes: Scrapes) -> None:
    pages = scrapes.pages
    router = pages["router"]
    assert router.value("pdserve:request_success_total", finished_reason="length") >= 2
    assert router.value("pdserve:time_to_first_token_seconds_count", route="remote") >= 1
    assert router.value("pdserve:time_to_first_token_seconds_count", route="local") >= 1
    assert router.value("pdserve:inter_token_latency_seconds_count") >= 6
    assert router.value("pdserve:request_generation_tokens_sum") >= 8
    assert router.value("pdserve:generation_tokens_total") >= 8
    assert router.value("pdserve:prompt_tokens_total") > REMOTE_THRESHOLD
    assert router.value("pdserve_router_decisions_total", route="remote") >= 1
    prefill = pages["prefill-0"]
    assert prefill.value("pdserve_prefill_kv_transfer_bytes_total") > 0

