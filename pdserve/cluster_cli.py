"""CLI subcommands that work on a cluster from outside its processes: start a local one
(`cluster up`: Redis, the router and the workers as child processes, `pdserve.cluster.
LocalCluster`), send it a prompt (`ask`), probe a router or worker (`health`, for container
healthchecks) and make its TLS certificates (`certs`). The commands that run a service in
their own process are `pdserve.services_cli`, whose router flags `cluster up` shares."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

from pdserve.cli_args import (
    add_api_key_args,
    add_cluster_secret_arg,
    add_engine_args,
    add_insecure_arg,
    add_log_level_arg,
    add_tls_args,
    api_keys,
    cluster_secret,
    engine_argv,
    exposure_problem,
    missing_credentials,
    positive_int,
    tls_client_files,
)
from pdserve.cluster import (
    DEFAULT_PREFILL_NICE,
    LocalCluster,
    new_cluster_secret,
    redact_url,
    stream_completion,
)
from pdserve.services_cli import Adder, add_router_flags, config_error, served_name
from pdserve.settings import add_flags, flags, from_args, to_argv

__all__ = ["register"]


def _cmd_cluster(args: argparse.Namespace) -> int:
    from router.config import RouterConfig

    # The children check their own listeners too; this refuses before anything starts.
    # The cluster secret is never missing (one is made below), API keys may be.
    problem = exposure_problem(args.host, missing_credentials(api_keys=api_keys(args),
                                                              needs_secret=False),
                               args.insecure)
    if problem:
        raise SystemExit(f"pdserve cluster up: {problem}")
    try:  # checked here, before anything starts, as the router will check it
        from_args(RouterConfig, args)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise config_error(args, exc) from None
    router_args = to_argv(flags(RouterConfig), args)  # those not at their defaults
    served = served_name(args)
    worker_args = engine_argv(args)
    if served:
        router_args += ["--served-model-name", served]
        worker_args += ["--served-model-name", served]
    if args.insecure:
        router_args.append("--insecure")
        worker_args.append("--insecure")
    if args.data_plane != "python":
        router_args += ["--data-plane", args.data_plane]
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


def register(sub: Any, add: Adder) -> None:
    """Add `cluster up`, `ask`, `health` and `certs` to `sub`; `add(sub, name, help)` makes
    a subparser."""
    from router.config import RouterConfig

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
    g.add_argument("--prefill-nice", type=int, default=DEFAULT_PREFILL_NICE,
                   help="nice value of prefill workers, which share every CPU with the decode "
                   "workers at a lower priority")
    g.add_argument("--ready-timeout", type=float, default=300.0,
                   help="seconds to wait for every process to be ready before giving up")
    g.add_argument("--tls", action="store_true",
                   help="TLS on every hop: make a private CA and a certificate per process "
                   "in the cluster's log directory (tls/), serve HTTPS and gRPC over TLS, "
                   "mTLS between router and workers (clients use tls/ca.crt, and "
                   "tls/client.crt + client.key where a certificate is wanted)")
    g.add_argument("--data-plane", choices=("python", "compiled"), default="python",
                   help="who serves the router's gRPC API: grpc.aio, or the compiled data "
                   "plane (grpc++ relays local routes, Python decides; router.dataplane)")
    add_log_level_arg(g)  # type: ignore[arg-type]
    add_cluster_secret_arg(g)  # type: ignore[arg-type]
    add_router_flags(up)
    add_flags(up, flags(RouterConfig))  # passed on to the router
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
