"""`python -m pdserve.gateway`: the colocated baseline, one engine behind the REST gateway.

Flags and environment variables are read here only; the flags are spelled as in `pdserve
router` (`pdserve.cli_args`): `--http-port` and `--max-request-bytes` (the older `--port`,
`--max-body-bytes` and `--request-timeout-s` still work, hidden from --help). Keys:
`--api-key`, repeatable, else the comma-separated PDSERVE_API_KEY (or PDSERVE_API_KEYS).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from pdserve.cli_args import (
    HelpFormatter,
    add_api_key_args,
    add_engine_args,
    add_insecure_arg,
    add_log_level_arg,
    add_tls_args,
    api_key_policies,
    api_keys,
    engine_config_from_args,
    exposure_problem,
    is_loopback,
    missing_credentials,
    positive_float,
    positive_int,
    served_name_default,
    tls_config,
    version,
)


def _gateway_defaults() -> Any:
    """GatewayConfig's defaults: the flags' defaults are its fields'."""
    from pdserve.gateway.config import GatewayConfig

    return GatewayConfig()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdserve.gateway", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"pdserve {version()}")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; off loopback, refused without API keys unless "
                   "--insecure")
    add_insecure_arg(p)
    p.add_argument("--http-port", dest="port", type=int, default=8000,
                   help="HTTP port (as `pdserve router --http-port`)")
    p.add_argument("--port", dest="port", type=int, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # the older spelling
    p.add_argument("--served-model-name", default=None,
                   help="model id clients must send (default: the Hugging Face id for a "
                   "cached hub model, else the model directory's name)")
    add_api_key_args(p)
    p.add_argument("--metrics-require-auth", action="store_true",
                   help="ask for an API key on /metrics too (default: open to scrapers)")
    defaults = _gateway_defaults()
    p.add_argument("--max-request-bytes", dest="max_body_bytes", type=positive_int,
                   default=defaults.max_body_bytes, metavar="BYTES",
                   help="largest request body, else 413 (as `pdserve router "
                   "--max-request-bytes`)")
    p.add_argument("--max-body-bytes", dest="max_body_bytes", type=positive_int,
                   default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # the older spelling
    p.add_argument("--default-max-tokens", type=positive_int,
                   default=defaults.default_max_tokens, metavar="N",
                   help="max_tokens of a request that names none")
    p.add_argument("--request-timeout", dest="request_timeout_s", type=positive_float,
                   default=defaults.request_timeout_s, metavar="SECONDS",
                   help="bound on one whole generation, arrival to last token")
    p.add_argument("--request-timeout-s", dest="request_timeout_s", type=positive_float,
                   default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # the older spelling
    add_log_level_arg(p)
    add_tls_args(p, client_auth=True)
    return p


async def _run(args: argparse.Namespace, tls: Any) -> None:
    from pdserve.engine.async_engine import AsyncEngine, load_engine
    from pdserve.engine.model_store import resolve_model
    from pdserve.gateway.app import GatewayConfig, create_app
    from pdserve.gateway.local_backend import EngineBackend
    from pdserve.gateway.server import serve
    from pdserve.runtime import stop_event_on_signals

    config = GatewayConfig(
        api_keys=frozenset(api_keys(args)), key_policies=api_key_policies(args),
        max_body_bytes=args.max_body_bytes, default_max_tokens=args.default_max_tokens,
        request_timeout_s=args.request_timeout_s,
        served_model_name=args.served_model_name or served_name_default(args.model),
        metrics_require_auth=args.metrics_require_auth)
    model_dir = resolve_model(args.model)
    engine = await load_engine(model_dir, engine_config_from_args(args))
    assert engine.tokenizer is not None
    stop = stop_event_on_signals()
    async with AsyncEngine(engine) as aeng:
        backend = EngineBackend(aeng, engine.tokenizer, model_dir.name)
        await serve(create_app(backend, config), args.host, args.port, stop=stop,
                    log_level=args.log_level.lower(), tls=tls)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    missing = missing_credentials(api_keys=api_keys(args), needs_secret=False)
    problem = exposure_problem(args.host, missing, args.insecure)
    if problem:  # fail closed, before anything is loaded or bound
        raise SystemExit(f"python -m pdserve.gateway: {problem}")
    tls = tls_config(args)  # checked before anything is loaded
    from pdserve.rpc.auth import warn_insecure_listener, warn_no_api_keys
    from pdserve.runtime import configure_logging

    configure_logging(args.log_level, json=False)
    warn_no_api_keys(api_keys(args), "gateway")
    if missing and not is_loopback(args.host):  # --insecure
        warn_insecure_listener("gateway", args.host, missing)
    asyncio.run(_run(args, tls))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
