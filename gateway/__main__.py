"""`python -m gateway`: the colocated baseline, one engine behind the REST gateway.

Flags and environment variables are read here only (PDSERVE_API_KEYS: comma-separated keys).
"""

from __future__ import annotations

import argparse
import asyncio
import os


def _parser() -> argparse.ArgumentParser:
    from pdserve.cli import _add_engine_args

    p = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    _add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="model id clients must send (default: the model directory's name)")
    p.add_argument("--api-key", action="append", default=[],
                   help="accepted bearer key (repeatable); also PDSERVE_API_KEYS")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--log-level", default="INFO")
    return p


async def _run(args: argparse.Namespace) -> None:
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import LLMEngine
    from engine.model_store import resolve_model
    from gateway.app import GatewayConfig, create_app
    from gateway.local_backend import EngineBackend
    from gateway.server import serve
    from pdserve.cli import engine_config_from_args
    from pdserve.runtime import stop_event_on_signals

    env_keys = [k.strip() for k in os.environ.get("PDSERVE_API_KEYS", "").split(",")]
    config = GatewayConfig(
        api_keys=frozenset(k for k in [*args.api_key, *env_keys] if k),
        max_body_bytes=args.max_body_bytes, default_max_tokens=args.default_max_tokens,
        request_timeout_s=args.request_timeout_s, served_model_name=args.served_model_name)
    model_dir = resolve_model(args.model)
    engine = LLMEngine.from_dir(model_dir, engine_config_from_args(args))
    assert engine.tokenizer is not None
    stop = stop_event_on_signals()
    async with AsyncEngine(engine) as aeng:
        backend = EngineBackend(aeng, engine.tokenizer, model_dir.name)
        await serve(create_app(backend, config), args.host, args.port, stop=stop,
                    log_level=args.log_level.lower())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from pdserve.runtime import configure_logging

    configure_logging(args.log_level, json=False)
    asyncio.run(_run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
