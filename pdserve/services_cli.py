"""CLI subcommands that run a service in this process: `decode-worker`, `prefill-worker`
and `router`, each from its one frozen config (built here from flags and environment) until
a stop signal. The commands that work on a cluster from outside (`cluster up`, `ask`,
`health`, `certs`) are `pdserve.cluster_cli`; flags shared with other commands come from
`pdserve.cli_args`."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

from pdserve.cli_args import (
    add_api_key_args,
    add_cluster_secret_arg,
    add_engine_args,
    add_insecure_arg,
    add_log_level_arg,
    add_model_arg,
    add_tls_args,
    api_key_policies,
    api_keys,
    cluster_secret,
    engine_config_from_args,
    exposure_problem,
    is_loopback,
    missing_credentials,
    served_name_default,
    tls_config,
)
from pdserve.cluster import REDIS_URL_ENV
from pdserve.settings import add_flags, flags, from_args

__all__ = ["Adder", "add_router_flags", "config_error", "parse_cpus", "register",
           "served_name"]

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def _common(p: argparse.ArgumentParser) -> None:
    # No default shown: it would print a password from the environment in --help.
    p.add_argument("--redis-url", default=None,
                   help=f"control-plane Redis (default: env {REDIS_URL_ENV}, else "
                   f"{DEFAULT_REDIS}); a URL with a password belongs in the environment, "
                   "since a command line is visible to every user (ps)")
    p.add_argument("--namespace", default=os.environ.get("PDSERVE_NAMESPACE", "default"),
                   help="Redis key prefix: one cluster per namespace (env PDSERVE_NAMESPACE)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address every listener binds (gRPC, HTTP, metrics; UCX: see "
                   "docs/ARCHITECTURE.md, Security); off loopback, refused without "
                   "credentials unless --insecure")
    add_cluster_secret_arg(p)
    add_insecure_arg(p)
    add_log_level_arg(p)


def _redis_url(args: argparse.Namespace) -> str:
    return str(args.redis_url or os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS)


def _fail_closed(args: argparse.Namespace, component: str, missing: list[str]
                 ) -> Callable[[], None]:
    """SystemExit when this process would listen off loopback without `missing`
    credentials (unless --insecure); else the start-up warnings to log once logging is set
    up (`_run_until_signal`)."""
    problem = exposure_problem(args.host, missing, args.insecure)
    if problem:
        raise SystemExit(f"pdserve {args.command}: {problem}")

    def warn() -> None:
        from pdserve.rpc.auth import warn_insecure_listener

        if missing and not is_loopback(args.host):
            warn_insecure_listener(component, args.host, missing)

    return warn


def _advertise_host(args: argparse.Namespace) -> str:
    """The host other processes use to reach this worker: --advertise-host, else --host,
    else (a wildcard bind, e.g. in a container) this machine's address."""
    if args.advertise_host:
        return str(args.advertise_host)
    if args.host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return str(args.host)


def _ucx_on_loopback(args: argparse.Namespace) -> None:
    """A worker whose addresses are all loopback keeps UCX's network transports there too
    (``UCX_NET_DEVICES=lo``, unless the operator set it): UCX's TCP transport otherwise
    listens on every interface's address, reachable off the host though nothing off the
    host could ever use it. Must run before the process's UCX context is created."""
    if "UCX_NET_DEVICES" not in os.environ and is_loopback(_advertise_host(args)) \
            and is_loopback(str(args.host)):
        os.environ["UCX_NET_DEVICES"] = "lo"


def _worker_id(prefix: str) -> str:
    return f"{prefix}-{socket.gethostname()}-{os.getpid()}"


# After a stop signal a process gets its drain timeout plus this much (leaving the registry,
# a directory poll, closing servers and clients) before the watchdog ends it.
_STOP_SLACK_S = 15.0


def _run_until_signal(main: Callable[[asyncio.Event], Any], log_level: str,
                      grace_s: float | None = None,
                      warn: Callable[[], None] | None = None) -> int:
    from pdserve.runtime import configure_logging, stop_event_on_signals

    configure_logging(log_level)
    if warn is not None:
        warn()

    async def runner() -> None:
        try:
            await main(stop_event_on_signals(exit_after_s=grace_s))
        finally:
            # With UCXPY_ENABLE_PYTHON_FUTURE (see pdserve.cli) ucxx runs a notifier thread
            # that interpreter exit would wait on forever: stop it while the loop still runs.
            ucxx = sys.modules.get("ucxx")
            if ucxx is not None:
                ucxx.stop_notifier_thread()

    from pdserve.errors import ModelLoadError
    from pdserve.runtime import ListenError

    try:
        asyncio.run(runner())
    except (ModelLoadError, ListenError) as exc:
        # A model or KV pool this host cannot hold, a port taken or an address not this
        # host's: a setting, not a bug. Say so, no trace.
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 1
    return 0


def parse_cpus(spec: str) -> set[int]:
    """"0-3,6" -> {0, 1, 2, 3, 6} (the taskset/cpuset list syntax)."""
    cpus: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in spec.split(","))):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad CPU list {spec!r}: {exc}") from exc
    if not cpus:
        raise argparse.ArgumentTypeError(f"empty CPU list {spec!r}")
    return cpus


def _place_process(args: argparse.Namespace) -> None:
    """Apply --cpus and --nice to every thread of this process, before the engine starts its
    own (a new thread takes its creator's). On Linux both are a thread's, not the process's,
    and imports may have started threads already: set on the main thread alone, those stayed
    on every CPU at the worker's old priority."""
    for tid in _threads():
        try:
            if args.cpus is not None:
                os.sched_setaffinity(tid, args.cpus)
            if args.nice:
                os.setpriority(os.PRIO_PROCESS, tid,
                               os.getpriority(os.PRIO_PROCESS, tid) + args.nice)
        except ProcessLookupError:
            pass  # that thread has ended


def _threads() -> list[int]:
    """This process's threads (Linux: /proc/self/task), else 0 (the calling thread)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def served_name(args: argparse.Namespace) -> str | None:
    """--served-model-name, else `served_name_default` (None: the model directory's name)."""
    return args.served_model_name or served_name_default(args.model)


def _worker_config(cls: type, args: argparse.Namespace, role: str, **given: Any) -> Any:
    """The worker's one config: its flags (the `setting()` fields of `cls`) and the rest."""
    try:
        return from_args(
            cls, args, worker_id=args.worker_id or _worker_id(role), redis_url=_redis_url(args),
            model=args.model, engine=engine_config_from_args(args), host=args.host,
            advertise_host=_advertise_host(args), namespace=args.namespace,
            served_model_name=served_name(args), cluster_secret=cluster_secret(args),
            tls=tls_config(args), **given)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise config_error(args, exc) from None


def _cmd_decode(args: argparse.Namespace) -> int:
    from decode_svc.config import DecodeConfig
    from decode_svc.main import run_decode

    secret = cluster_secret(args)
    warn = _fail_closed(args, "decode_worker", missing_credentials(secret=secret))
    _place_process(args)  # first: the engine's default thread count is the CPUs it may use
    cfg = _worker_config(DecodeConfig, args, "decode", ucx_host=_advertise_host(args))
    _ucx_on_loopback(args)
    return _run_until_signal(lambda stop: run_decode(cfg, stop), args.log_level,
                             cfg.drain_timeout_s + _STOP_SLACK_S, warn)


def _cmd_prefill(args: argparse.Namespace) -> int:
    from prefill_svc.config import PrefillConfig
    from prefill_svc.main import run_prefill

    secret = cluster_secret(args)
    warn = _fail_closed(args, "prefill_worker", missing_credentials(secret=secret))
    _place_process(args)  # first: the engine's default thread count is the CPUs it may use
    cfg = _worker_config(PrefillConfig, args, "prefill")
    _ucx_on_loopback(args)
    return _run_until_signal(lambda stop: run_prefill(cfg, stop), args.log_level,
                             cfg.drain_timeout_s + _STOP_SLACK_S, warn)


def config_error(args: argparse.Namespace, exc: Exception) -> SystemExit:
    """A config that its own checks refuse (a combination no single flag's type catches):
    a usage error, exit code 2."""
    command = " ".join(filter(None, (args.command, getattr(args, "cluster_command", None))))
    print(f"pdserve {command}: error: {exc}", file=sys.stderr)
    return SystemExit(2)


def _router_config(args: argparse.Namespace, keys: frozenset[str], secret: Any) -> Any:
    """The router process's one config: its flags (`router.config`) and the rest."""
    from router.config import RouterProcessConfig

    try:
        return from_args(
            RouterProcessConfig, args, redis_url=_redis_url(args), model=args.model,
            namespace=args.namespace, host=args.host, api_keys=keys,
            key_policies=api_key_policies(args), served_model_name=served_name(args),
            cluster_secret=secret, tls=tls_config(args))
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise config_error(args, exc) from None


def _cmd_router(args: argparse.Namespace) -> int:
    keys, secret = frozenset(api_keys(args)), cluster_secret(args)
    exposed = _fail_closed(args, "router", missing_credentials(api_keys=keys, secret=secret))

    def warn() -> None:
        from pdserve.rpc.auth import warn_no_api_keys

        exposed()
        warn_no_api_keys(keys, "router")

    from router.main import run_router

    cfg = _router_config(args, keys, secret)
    return _run_until_signal(lambda stop: run_router(cfg, stop), args.log_level,
                             cfg.drain_timeout_s + _STOP_SLACK_S, warn)


Adder = Callable[..., argparse.ArgumentParser]


def _served_name_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--served-model-name", default=None,
                   help=f"model name {what} (default: the Hugging Face id for a cached hub "
                   "model, else the model directory's name)")


def _worker_parser(add: Adder, sub: Any, role: str, fn: Callable[..., int]) -> None:
    p = add(sub, f"{role}-worker", f"run a {role} worker")
    _common(p)
    add_engine_args(p)
    _served_name_arg(p, "in metric labels")
    p.add_argument("--worker-id", default=None,
                   help="name in the registry (default: <role>-<hostname>-<pid>)")
    p.add_argument("--cpus", type=parse_cpus, default=None,
                   help="run on these CPUs only, e.g. 0-3 (default: all allowed)")
    p.add_argument("--nice", type=int, default=0,
                   help="raise the process's nice value by this much (lower CPU priority)")
    p.add_argument("--advertise-host", default=os.environ.get("PDSERVE_ADVERTISE_HOST"),
                   help="host the router and other workers use to reach this worker "
                   "(default: --host, or this machine's address when --host is 0.0.0.0; "
                   "env PDSERVE_ADVERTISE_HOST)")
    add_tls_args(p)
    add_flags(p, flags(_worker_config_class(role)))
    p.set_defaults(func=fn)


def _worker_config_class(role: str) -> type:
    if role == "decode":
        from decode_svc.config import DecodeConfig

        return DecodeConfig
    from prefill_svc.config import PrefillConfig

    return PrefillConfig


def add_router_flags(p: argparse.ArgumentParser) -> None:
    """Flags `pdserve router` and `pdserve cluster up` share besides the
    `router.config.RouterConfig` settings each adds (placement, timeouts, liveness,
    admission): API keys and the served name."""
    add_api_key_args(p)
    _served_name_arg(p, "clients send and /v1/models lists")


def register(sub: Any, add: Adder) -> None:
    """Add the service subcommands to `sub`; `add(sub, name, help)` makes a subparser."""
    _worker_parser(add, sub, "decode", _cmd_decode)
    _worker_parser(add, sub, "prefill", _cmd_prefill)

    r = add(sub, "router", "run the router (gRPC) and the OpenAI HTTP gateway")
    _common(r)
    add_model_arg(r)
    add_router_flags(r)
    add_tls_args(r, client_auth=True, server_name=True)
    from router.config import RouterProcessConfig

    add_flags(r, flags(RouterProcessConfig))  # the process's and RouterConfig's
    r.set_defaults(func=_cmd_router)
