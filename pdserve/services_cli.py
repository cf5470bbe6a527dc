"""CLI subcommands for the services: workers, router, a local cluster, a client and a
health probe. Flags shared with other commands come from `pdserve.cli_args`; the cluster
itself is `pdserve.cluster.LocalCluster`."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
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
    engine_argv,
    engine_config_from_args,
    exposure_problem,
    is_loopback,
    missing_credentials,
    positive_int,
    served_name_default,
    tls_client_files,
    tls_config,
)
from pdserve.cluster import (
    REDIS_URL_ENV,
    LocalCluster,
    new_cluster_secret,
    redact_url,
    stream_completion,
)
from pdserve.settings import add_flags, flags, from_args, to_argv

__all__ = ["LocalCluster", "parse_cpus", "register"]

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

    asyncio.run(runner())
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
    """Apply --cpus and --nice before the engine starts its threads."""
    if args.cpus is not None:
        os.sched_setaffinity(0, args.cpus)
    if args.nice:
        os.nice(args.nice)


def _served_name(args: argparse.Namespace) -> str | None:
    return args.served_model_name or served_name_default(args.model)


def _worker_config(cls: type, args: argparse.Namespace, role: str, **given: Any) -> Any:
    """The worker's one config: its flags (the `setting()` fields of `cls`) and the rest."""
    try:
        return from_args(
            cls, args, worker_id=args.worker_id or _worker_id(role), redis_url=_redis_url(args),
            model=args.model, engine=engine_config_from_args(args), host=args.host,
            advertise_host=_advertise_host(args), namespace=args.namespace,
            served_model_name=_served_name(args), cluster_secret=cluster_secret(args),
            tls=tls_config(args), **given)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise _config_error(args, exc) from None


def _cmd_decode(args: argparse.Namespace) -> int:
    from decode_svc.config import DecodeConfig
    from decode_svc.main import run_decode

    secret = cluster_secret(args)
    warn = _fail_closed(args, "decode_worker", missing_credentials(secret=secret))
    cfg = _worker_config(DecodeConfig, args, "decode", ucx_host=_advertise_host(args))
    _ucx_on_loopback(args)
    _place_process(args)
    return _run_until_signal(lambda stop: run_decode(cfg, stop), args.log_level,
                             cfg.drain_timeout_s + _STOP_SLACK_S, warn)


def _cmd_prefill(args: argparse.Namespace) -> int:
    from prefill_svc.config import PrefillConfig
    from prefill_svc.main import run_prefill

    secret = cluster_secret(args)
    warn = _fail_closed(args, "prefill_worker", missing_credentials(secret=secret))
    cfg = _worker_config(PrefillConfig, args, "prefill")
    _ucx_on_loopback(args)
    _place_process(args)
    return _run_until_signal(lambda stop: run_prefill(cfg, stop), args.log_level,
                             cfg.drain_timeout_s + _STOP_SLACK_S, warn)


def _config_error(args: argparse.Namespace, exc: Exception) -> SystemExit:
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
            key_policies=api_key_policies(args), served_model_name=_served_name(args),
            cluster_secret=secret, tls=tls_config(args))
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise _config_error(args, exc) from None


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


def _cmd_cluster(args: argparse.Namespace) -> int:
    # The children check their own listeners too; this refuses before anything starts.
    # The cluster secret is never missing (one is made below), API keys may be.
    problem = exposure_problem(args.host, missing_credentials(api_keys=api_keys(args),
                                                              needs_secret=False),
                               args.insecure)
    if problem:
        raise SystemExit(f"pdserve cluster up: {problem}")
    try:  # checked here, before anything starts, as the router will check it
        from_args(_routing_config(), args)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise _config_error(args, exc) from None
    router_args = to_argv(flags(_routing_config()), args)  # those not at their defaults
    served = _served_name(args)
    worker_args = engine_argv(args)
    if served:
        router_args += ["--served-model-name", served]
        worker_args += ["--served-model-name", served]
    if args.insecure:
        router_args.append("--insecure")
        worker_args.append("--insecure")
    # Secrets go to the children in their environment, never on a command line (ps shows it).
    env = {"PDSERVE_LOG_LEVEL": args.log_level}
    if args.api_key:
        env["PDSERVE_API_KEY"] = ",".join(args.api_key)
    if args.api_key_file:  # the path, not the keys
        env["PDSERVE_API_KEY_FILE"] = str(Path(args.api_key_file).resolve())
    secret = cluster_secret(args)  # --cluster-secret-file, else PDSERVE_CLUSTER_SECRET
    cluster = LocalCluster(prefill=args.prefill, decode=args.decode, redis_url=args.redis_url,
                           model=args.model, http_port=args.http_port, grpc_port=args.port,
                           extra_worker_args=tuple(worker_args), router_args=tuple(router_args),
                           prefill_nice=args.prefill_nice, env=env, host=args.host,
                           cluster_secret=new_cluster_secret() if secret is None
                           else secret.value.decode(), tls=args.tls)
    print(f"starting cluster: {args.prefill} prefill, {args.decode} decode workers "
          f"(logs in {cluster.log_dir})", file=sys.stderr)
    stop = started = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True
        if not started:  # still starting: abandon the start; `finally` stops what runs
            raise SystemExit(0)

    # Installed before anything starts, so a signal at any point stops the children too
    # (and if this process is SIGKILLed, PR_SET_PDEATHSIG stops them: see LocalCluster).
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        cluster.start(args.ready_timeout)
        started = True
        print(f"ready: HTTP {cluster.http_url}  gRPC {cluster.grpc_address}  "
              f"redis {redact_url(str(cluster.redis_url))}", file=sys.stderr)
        if cluster.tls_dir is not None:
            print(f"TLS: CA {cluster.tls_dir / 'ca.crt'}, client certificate "
                  f"{cluster.tls_dir / 'client.crt'} (key client.key)", file=sys.stderr)
        if args.demo:
            print(f"> {args.demo}", file=sys.stderr)
            stream_completion(cluster.http_url, args.demo, args.max_tokens,
                              headers=cluster.auth_headers(), verify=cluster.http_verify())
            return 0
        while not stop:
            time.sleep(0.5)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a repeated signal must not cut close()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        cluster.close()
    return 0


def _cmd_ask(args: argparse.Namespace) -> int:
    import httpx

    keys = api_keys(args)
    try:
        stream_completion(args.url, args.prompt, args.max_tokens, model=args.model_name,
                          temperature=args.temperature,
                          headers={"Authorization": f"Bearer {keys[0]}"} if keys else None,
                          verify=_https_verify(args))
    except (RuntimeError, httpx.HTTPError, ValueError) as exc:  # refused, nobody listening
        print(f"pdserve ask: {exc}", file=sys.stderr)
        return 1
    return 0


def _https_verify(args: argparse.Namespace) -> Any:
    """httpx's `verify` for a command that dials: the CA (and client certificate) of the
    TLS flags, else the system's CAs (True)."""
    files = tls_client_files(args)
    if files is None:
        return True
    from pdserve.rpc.tls import client_context

    return client_context(*files)


def _grpc_channel(args: argparse.Namespace, target: str) -> Any:
    """A blocking channel to `target`: TLS with the TLS flags (CA, client certificate,
    --tls-server-name), else plaintext."""
    import grpc

    files = tls_client_files(args)
    if files is None:
        return grpc.insecure_channel(target)
    from pdserve.rpc.tls import client_channel_credentials

    options = ([("grpc.ssl_target_name_override", args.tls_server_name)]
               if args.tls_server_name else [])
    return grpc.secure_channel(target, client_channel_credentials(*files), options=options)


def _cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when the target reports healthy, 1 otherwise (with the reason on stderr)."""
    try:
        verify = _https_verify(args)
    except ValueError as exc:
        print(f"pdserve health: {exc}", file=sys.stderr)
        return 1
    if args.http:
        import httpx

        try:
            r = httpx.get(args.http, timeout=args.timeout, verify=verify)
        except httpx.HTTPError as exc:
            print(f"unhealthy: {args.http}: {exc}", file=sys.stderr)
            return 1
        print(f"{args.http}: HTTP {r.status_code}", file=sys.stderr)
        return 0 if r.status_code == 200 else 1
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with _grpc_channel(args, args.grpc) as channel:
        try:
            # HealthStub's stubs omit the methods it sets up per channel (types-grpcio-health).
            resp = health_pb2_grpc.HealthStub(channel).Check(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"unhealthy: {args.grpc}: {exc.code().name}: {exc.details()}",
                  file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{args.grpc} {args.service or '(server)'}: {status}", file=sys.stderr)
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def _cmd_certs(args: argparse.Namespace) -> int:
    from pdserve.certs import DEFAULT_NAMES, make_local_pki

    try:
        issued = make_local_pki(args.out, args.name or DEFAULT_NAMES, args.host,
                                days=args.days)
    except (ValueError, OSError) as exc:
        print(f"pdserve certs: {exc}", file=sys.stderr)
        return 1
    print(f"CA: {Path(args.out) / 'ca.crt'} (its key ca.key stays here)", file=sys.stderr)
    for cert in issued:
        print(f"{cert.name}: --tls-cert {cert.cert} --tls-key {cert.key}", file=sys.stderr)
    return 0


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


def _routing_config() -> type:
    from router.config import RouterConfig

    return RouterConfig


def _router_flags(p: argparse.ArgumentParser) -> None:
    """Flags `pdserve router` and `pdserve cluster up` share: API keys, the served name and
    every `router.config.RouterConfig` setting (placement, timeouts, liveness, admission)."""
    add_api_key_args(p)
    _served_name_arg(p, "clients send and /v1/models lists")


def register(sub: Any, add: Adder) -> None:
    """Add the service subcommands to `sub`; `add(sub, name, help)` makes a subparser."""
    _worker_parser(add, sub, "decode", _cmd_decode)
    _worker_parser(add, sub, "prefill", _cmd_prefill)

    r = add(sub, "router", "run the router (gRPC) and the OpenAI HTTP gateway")
    _common(r)
    add_model_arg(r)
    _router_flags(r)
    add_tls_args(r, client_auth=True, server_name=True)
    from router.config import RouterProcessConfig

    add_flags(r, flags(RouterProcessConfig))  # the process's and RouterConfig's
    r.set_defaults(func=_cmd_router)

    c = add(sub, "cluster", "local cluster on 127.0.0.1")
    csub = c.add_subparsers(dest="cluster_command", required=True, metavar="COMMAND")
    up = add(csub, "up", "start Redis, the router and the workers; serve until Ctrl-C")
    g = up.add_argument_group("cluster")
    g.add_argument("--prefill", type=int, default=1, help="prefill workers")
    g.add_argument("--decode", type=int, default=1, help="decode workers")
    g.add_argument("--redis-url", default=None,
                   help="use this Redis (default: a private one on 127.0.0.1 with a random "
                   "password); its children get it in their environment")
    g.add_argument("--host", default="127.0.0.1",
                   help="address the router and workers listen on; off loopback, refused "
                   "without API keys unless --insecure")
    add_insecure_arg(g)  # type: ignore[arg-type]
    g.add_argument("--http-port", type=int, default=8000, help="router HTTP gateway port")
    g.add_argument("--port", type=int, default=50051, help="router gRPC port")
    g.add_argument("--demo", default=None, help="send this prompt, print the answer, stop")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens the --demo answer may use")
    g.add_argument("--prefill-nice", type=int, default=5,
                   help="nice value of prefill workers, which share every CPU with the decode "
                   "workers at a lower priority")
    g.add_argument("--ready-timeout", type=float, default=300.0,
                   help="seconds to wait for every process to be ready before giving up")
    g.add_argument("--tls", action="store_true",
                   help="TLS on every hop: make a private CA and a certificate per process "
                   "in the cluster's log directory (tls/), serve HTTPS and gRPC over TLS, "
                   "mTLS between router and workers (clients use tls/ca.crt, and "
                   "tls/client.crt + client.key where a certificate is wanted)")
    add_log_level_arg(g)  # type: ignore[arg-type]
    add_cluster_secret_arg(g)  # type: ignore[arg-type]
    _router_flags(up)
    add_flags(up, flags(_routing_config()))  # passed on to the router
    add_engine_args(up)  # passed on to every worker
    up.set_defaults(func=_cmd_cluster)

    a = add(sub, "ask", "send a chat prompt to a running gateway and stream the answer")
    a.add_argument("prompt", help="the user message")
    a.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's base URL")
    a.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    a.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (0: greedy)")
    a.add_argument("--model", dest="model_name", default="default",
                   help="model name sent in the request")
    add_api_key_args(a)
    add_tls_args(a, client=True)
    a.set_defaults(func=_cmd_ask)

    h = add(sub, "health", "probe a router or worker: exit 0 when it serves (for "
            "container healthchecks)")
    target = h.add_mutually_exclusive_group(required=True)
    target.add_argument("--grpc", metavar="HOST:PORT",
                        help="ask this gRPC server's grpc.health.v1 service")
    target.add_argument("--http", metavar="URL", help="GET this URL, e.g. the router's "
                        "http://127.0.0.1:8000/health")
    h.add_argument("--service", default="",
                   help="gRPC service name to check ('': the whole server)")
    h.add_argument("--timeout", type=float, default=3.0, help="seconds before giving up")
    add_tls_args(h, server_name=True, client=True)
    h.set_defaults(func=_cmd_health)

    ce = add(sub, "certs", "make a local CA and a TLS certificate per process (--tls-* flags)")
    ce.add_argument("--out", required=True, metavar="DIR",
                    help="directory for ca.crt/ca.key and NAME.crt/NAME.key (made mode 700; "
                    "files mode 600); an existing CA there is reused")
    ce.add_argument("--name", action="append", default=[], metavar="NAME",
                    help="a certificate to issue, repeatable (default: router, prefill, "
                    "decode, client)")
    ce.add_argument("--host", action="append", default=[], metavar="HOST",
                    help="a host name or address the certificates are valid for, besides "
                    "localhost, 127.0.0.1 and ::1; repeatable")
    ce.add_argument("--days", type=positive_int, default=365,
                    help="days the certificates are valid")
    ce.set_defaults(func=_cmd_certs)
