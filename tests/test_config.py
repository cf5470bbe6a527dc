"""One validated config per process (issue 17): every router and worker setting is a field
of its config dataclass and a flag generated from it (pdserve.settings), so each timeout,
cap and lease bound is settable from the command line; values out of range are refused both
as flags (usage errors naming the flag) and in code (ValueError naming field and flag).
Fast: nothing is started."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from decode_svc.config import DecodeConfig
from pdserve.cli import build_parser
from pdserve.services_cli import _router_config, _worker_config
from pdserve.settings import SETTING, Flag, flags, from_args, to_argv
from pdserve.types import LatencyClass
from prefill_svc.config import PrefillConfig
from router.admission import AdmissionConfig
from router.config import ADMISSION_SETTINGS, POLICY_SETTINGS, RouterConfig, RouterProcessConfig
from router.liveness import LivenessConfig
from router.policy import RouterPolicy
from router.remote import RemoteTimeouts

# Fields of RouterConfig that are not flags, and why.
NOT_FLAGS = {
    "policy": "nested: RouterPolicy's fields are flags (POLICY_SETTINGS)",
    "admission": "nested: AdmissionConfig's fields are flags (ADMISSION_SETTINGS)",
    "cost": "the cost model's priors and weights (router.cost): tuning in code, no bounds",
}


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def _other_value(fl: Flag) -> tuple[list[str], Any]:
    """A valid non-default value of `fl`: (its command-line items, the field value)."""
    s = fl.setting
    if s.negate:
        return [fl.option], not fl.default
    if fl.kind is bool:
        return [fl.option], True
    if s.parse is not None:
        items = ["interactive=0.5", "batch=0.25"]
        return [a for i in items for a in (fl.option, i)], s.parse(items)
    if s.choices:
        value = next(c for c in s.choices if c != fl.default)
        return [fl.option, value], value
    if fl.kind is int:
        value = (fl.default or 1) + 1
        if s.le is not None and value > s.le:
            value = int(s.le) - 1
        return [fl.option, str(value)], value * s.scale
    value = (fl.default or 1.0) / 2 if s.le is not None else (fl.default or 1.0) * 2 + 0.5
    return [fl.option, repr(value)], value


def _at(config: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        config = getattr(config, name)
    return config


# --------------------------------------------------------------------------- the router


def test_every_router_setting_is_a_flag() -> None:
    for f in dataclasses.fields(RouterConfig):
        assert SETTING in f.metadata or f.name in NOT_FLAGS, f.name
    assert set(POLICY_SETTINGS) == {f.name for f in dataclasses.fields(RouterPolicy)}
    assert set(ADMISSION_SETTINGS) == {f.name for f in dataclasses.fields(AdmissionConfig)}
    # The timeouts the router's parts take are all RouterConfig's, so all flags.
    config = RouterConfig()
    settable = {f.name for f in dataclasses.fields(RouterConfig) if SETTING in f.metadata}
    for part in (LivenessConfig, RemoteTimeouts):
        assert {f.name for f in dataclasses.fields(part)} <= settable, part
    assert config.liveness == LivenessConfig() and config.remote == RemoteTimeouts()


@pytest.mark.parametrize("fl", flags(RouterProcessConfig), ids=lambda fl: fl.option)
def test_each_router_flag_reaches_its_field(fl: Flag) -> None:
    argv, expected = _other_value(fl)
    config = _router_config(_parse("router", *argv), frozenset(), None)
    value = _at(config, fl.path)
    if isinstance(expected, dict):
        assert {**value, **expected} == dict(value), fl.option
    else:
        assert value == expected, fl.option
    # Every other setting keeps its default.
    default = _router_config(_parse("router"), frozenset(), None)
    for other in flags(RouterProcessConfig):
        if other.path != fl.path:
            assert _at(config, other.path) == _at(default, other.path), (fl.option, other.option)


def test_router_defaults_are_the_dataclasses() -> None:
    config = _router_config(_parse("router"), frozenset(), None)
    assert config.router == RouterConfig()
    assert config == RouterProcessConfig(redis_url=config.redis_url, model=config.model,
                                         namespace=config.namespace)


@pytest.mark.parametrize("argv,needle", [
    (["--token-timeout", "0"], "--token-timeout: must be > 0"),
    (["--allocate-timeout", "-1"], "--allocate-timeout: must be > 0"),
    (["--prefill-timeout", "nan"], "--prefill-timeout: must be > 0"),
    (["--max-decode-attempts", "0"], "--max-decode-attempts: must be >= 1"),
    (["--max-migrations", "1.5"], "--max-migrations: '1.5' is not an integer"),
    (["--batch-backlog-fraction", "1.5"], "--batch-backlog-fraction: must be > 0 and <= 1"),
    (["--placement", "random"], "--placement: must be one of threshold, cost"),
    (["--ttft-deadline", "fast=1"], "--ttft-deadline: expected CLASS=SECONDS"),
    (["--class-share", "batch=2"], "--class-share: the share of batch must be in (0, 1]"),
    (["--port", "70000"], "--port: must be >= 0 and <= 65535"),
    (["--max-request-bytes", "0"], "--max-request-bytes: must be >= 1"),
])
def test_out_of_range_router_flags_are_usage_errors(argv: list[str], needle: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _parse("router", *argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_router_config_checks_values_set_in_code() -> None:
    with pytest.raises(ValueError, match=r"RouterConfig.token_timeout_s \(--token-timeout\) "
                                         r"must be > 0, got 0"):
        RouterConfig(token_timeout_s=0)
    with pytest.raises(ValueError, match=r"RouterConfig.policy.batch_backlog_fraction "
                                         r"\(--batch-backlog-fraction\)"):
        RouterConfig(policy=RouterPolicy(batch_backlog_fraction=2.0))
    with pytest.raises(ValueError, match="--max-migrations"):
        RouterConfig(max_migrations=True)  # type: ignore[arg-type]  # not an integer
    with pytest.raises(ValueError, match="--min-retry-after"):
        RouterConfig(admission=AdmissionConfig(min_retry_after_s=9, max_retry_after_s=2))
    with pytest.raises(ValueError, match="--http-port"):
        RouterProcessConfig(redis_url="redis://x", http_port=-5)
    assert RouterProcessConfig(redis_url="redis://x", http_port=None).http_port is None
    assert RouterConfig(token_timeout_s=60).token_timeout_s == 60  # an int is a number


def test_a_bad_combination_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse("router", "--min-retry-after", "9", "--max-retry-after", "2")
    with pytest.raises(SystemExit) as info:
        _router_config(args, frozenset(), None)
    assert info.value.code == 2
    assert "pdserve router: error:" in capsys.readouterr().err


def test_cluster_up_passes_every_router_setting_on() -> None:
    argv = ["--token-timeout", "7.0", "--max-migrations", "0", "--no-admission",
            "--ttft-deadline", "interactive=3", "--placement", "threshold",
            "--ttft-target", "standard=2", "--ttft-weight", "batch=0.5",
            "--stall-probe-after", "2.5", "--directory-poll", "0.5"]
    up = _parse("cluster", "up", *argv)
    passed = to_argv(flags(RouterConfig), up)
    assert sorted(passed) == sorted(argv)
    assert to_argv(flags(RouterConfig), _parse("cluster", "up")) == []  # defaults: nothing
    router = _router_config(_parse("router", *passed), frozenset(), None).router
    assert router == from_args(RouterConfig, up)
    assert (router.token_timeout_s, router.max_migrations, router.admission.enabled,
            router.policy.placement, router.stall_probe_s, router.directory_poll_s) == \
        (7.0, 0, False, "threshold", 2.5, 0.5)
    assert router.policy.ttft_weights[LatencyClass.BATCH] == 0.5
    # Cost placement's target per class: its own, never past the admission deadline.
    assert (router.ttft_target_s(LatencyClass.STANDARD),
            router.ttft_target_s(LatencyClass.INTERACTIVE),
            router.ttft_target_s(LatencyClass.BATCH)) == (2.0, 1.0, 15.0)
    tight = RouterConfig(admission=AdmissionConfig(ttft_deadlines_s={LatencyClass.BATCH: 4.0}))
    assert tight.ttft_target_s(LatencyClass.BATCH) == 4.0


# --------------------------------------------------------------------------- workers


@pytest.mark.parametrize("role,cls", [("decode", DecodeConfig), ("prefill", PrefillConfig)])
def test_each_worker_flag_reaches_its_field(role: str, cls: type) -> None:
    for fl in flags(cls):
        argv, expected = _other_value(fl)
        if fl.name == "heartbeat_s":
            argv, expected = [fl.option, "2.5"], 2.5  # still under the lease
        config = _worker_config(cls, _parse(f"{role}-worker", *argv), role)
        assert _at(config, fl.path) == expected, fl.option
    default = _worker_config(cls, _parse(f"{role}-worker"), role)
    assert {fl.name: _at(default, fl.path) for fl in flags(cls)} == \
        {f.name: f.default for f in dataclasses.fields(cls) if SETTING in f.metadata}


def test_worker_settings_cover_timeouts_caps_and_leases() -> None:
    decode = {fl.option for fl in flags(DecodeConfig)}
    assert {"--lease-ttl", "--heartbeat", "--drain-timeout", "--max-requests",
            "--max-message-bytes", "--max-concurrent-rpcs", "--alloc-lease",
            "--max-alloc-lease", "--max-kv-wait", "--max-pending-kv-fraction"} <= decode
    prefill = {fl.option for fl in flags(PrefillConfig)}
    assert {"--max-concurrent-prefills", "--transfer-timeout", "--lease-ttl"} <= prefill


def test_worker_config_checks() -> None:
    common: dict[str, Any] = {"worker_id": "w", "redis_url": "redis://x"}
    with pytest.raises(ValueError, match=r"--heartbeat .* must be less than --lease-ttl"):
        PrefillConfig(**common, heartbeat_s=3.0, lease_ttl_s=3.0)
    with pytest.raises(ValueError, match="--alloc-lease"):
        DecodeConfig(**common, alloc_lease_s=200.0)
    with pytest.raises(ValueError, match=r"max_pending_kv_fraction \(--max-pending-kv-"):
        DecodeConfig(**common, max_pending_kv_fraction=0.0)
    with pytest.raises(ValueError, match="--max-concurrent-prefills"):
        PrefillConfig(**common, max_concurrent_prefills=0)
    assert DecodeConfig(**common, max_message_bytes=None).max_message_bytes is None


def test_a_worker_flag_combination_is_a_usage_error(capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    with pytest.raises(SystemExit) as info:
        _worker_config(DecodeConfig, _parse("decode-worker", "--heartbeat", "5"), "decode")
    assert info.value.code == 2
    assert "must be less than --lease-ttl" in capsys.readouterr().err
