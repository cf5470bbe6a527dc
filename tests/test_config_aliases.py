"""One flag vocabulary (issue 17): where two spellings named one setting, one is shown and the
older one still works, hidden from --help. Fast: parsers only."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from pdserve.cli import build_parser
from pdserve.gateway.__main__ import _parser as gateway_parser
from pdserve.settings import add_flags, flags, from_args, setting

# (old spelling, new spelling, value, dest) on the gateway's command line.
GATEWAY_ALIASES = [
    ("--port", "--http-port", "9001", "port"),
    ("--max-body-bytes", "--max-request-bytes", "4096", "max_body_bytes"),
    ("--request-timeout-s", "--request-timeout", "12.5", "request_timeout_s"),
]


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    out = [("python -m pdserve.gateway", gateway_parser())]
    todo = [("pdserve", build_parser())]
    while todo:
        name, parser = todo.pop()
        out.append((name, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [(f"{name} {n}", p) for n, p in action.choices.items()]
    return out


@pytest.mark.parametrize("old,new,value,dest", GATEWAY_ALIASES)
def test_gateway_old_spellings_still_work(old: str, new: str, value: str, dest: str) -> None:
    p = gateway_parser()
    assert getattr(p.parse_args([old, value]), dest) == getattr(p.parse_args([new, value]), dest)
    assert getattr(p.parse_args([old, value]), dest) != getattr(p.parse_args([]), dest)
    text = p.format_help()
    assert f"{new} " in text and f"{old} " not in text


def test_router_and_gateway_name_shared_limits_alike() -> None:
    router = dict(_parsers())["pdserve router"]
    for flag in ("--max-request-bytes", "--http-port", "--metrics-require-auth", "--api-key",
                 "--api-key-file", "--served-model-name", "--kv-cache-mb"):
        assert flag in gateway_parser().format_help(), flag
        assert flag in router.format_help() or flag == "--kv-cache-mb", flag


@pytest.mark.parametrize("name,parser", _parsers(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_hidden_flag_is_an_alias_of_a_shown_one(name: str,
                                                      parser: argparse.ArgumentParser) -> None:
    shown = {a.dest for a in parser._actions if a.help != argparse.SUPPRESS}
    for action in parser._actions:
        if action.help == argparse.SUPPRESS and action.option_strings:
            assert action.dest in shown, (name, action.option_strings)


@dataclass(frozen=True)
class _Config:
    wait_s: float = setting(1.5, "seconds to wait", aliases=("--wait-seconds",), gt=0)


def test_a_setting_alias_is_hidden_and_sets_the_same_field() -> None:
    p = argparse.ArgumentParser()
    add_flags(p, flags(_Config))
    assert from_args(_Config, p.parse_args(["--wait-seconds", "3"])).wait_s == 3.0
    assert from_args(_Config, p.parse_args(["--wait", "4"])).wait_s == 4.0
    assert from_args(_Config, p.parse_args([])).wait_s == 1.5
    assert "--wait-seconds" not in p.format_help() and "--wait " in p.format_help()
    with pytest.raises(SystemExit):
        p.parse_args(["--wait-seconds", "0"])  # the alias is checked like the flag
