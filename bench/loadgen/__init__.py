"""Load generator for OpenAI-compatible streaming endpoints on this machine.

    result = await run_load(RunConfig(url="http://127.0.0.1:8000", rate=2.0, num_requests=50))
    swept = await sweep(config, [0.5, 1, 2, 4], label="disagg")
    print(compare({"colocated": a, "disagg": b}))

Each run is bounded by `num_requests` and `max_duration_s`. Failed requests are results with
`error` set, never exceptions; they count as SLO misses.
"""

from bench.loadgen.config import SLO, RunConfig, check_local_url
from bench.loadgen.errors import ConfigError, LoadgenError, NonLocalTargetError, TargetError
from bench.loadgen.metrics import (
    Attainment,
    Goodput,
    GroupSummary,
    Percentiles,
    RequestResult,
    RunSummary,
    goodput,
    meets_slo,
    summarize,
)
from bench.loadgen.report import compare, format_run, run_to_dict, sweep_to_dict, write_sweep
from bench.loadgen.runner import RunResult, SweepResult, run_load, sweep
from bench.loadgen.workload import LengthDist, RequestClass, Workload, named_workload

__all__ = [
    "SLO",
    "Attainment",
    "ConfigError",
    "Goodput",
    "GroupSummary",
    "LengthDist",
    "LoadgenError",
    "NonLocalTargetError",
    "Percentiles",
    "RequestClass",
    "RequestResult",
    "RunConfig",
    "RunResult",
    "RunSummary",
    "SweepResult",
    "TargetError",
    "Workload",
    "check_local_url",
    "compare",
    "format_run",
    "goodput",
    "meets_slo",
    "named_workload",
    "run_load",
    "run_to_dict",
    "summarize",
    "sweep",
    "sweep_to_dict",
    "write_sweep",
]
