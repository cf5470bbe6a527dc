"""Who may call whom: the cluster secret (router <-> workers, KV writes) and the client API keys.

**Cluster secret.** Every process of one cluster is given the same secret
(`--cluster-secret-file` or ``PDSERVE_CLUSTER_SECRET``; `pdserve cluster up` makes a random one
per cluster and hands it to its children in their environment, never on a command line). The
secret itself never travels: each use has its own key derived from it with HMAC-SHA256
(`ClusterSecret.derive`), so the gRPC token (sent as ``x-pdserve-cluster-token`` call metadata
and checked by `token_interceptor` on every worker) cannot sign KV writes (`kv_key`, see
`kvxfer.protocol.sign_write`). Without TLS the gRPC token is a bearer token on the
wire: keep internal traffic on loopback or a private network (or terminate mTLS in a mesh).

Without a secret a process keeps today's open behaviour on loopback and says so once at
start-up (`warn_unauthenticated`), so tests and the single-host default keep working; off
loopback the command line refuses to start without one (`pdserve.cli_args.exposure_problem`)
unless ``--insecure`` is given, and then says so loudly (`warn_insecure_listener`).

**Secret quality.** `load_cluster_secret` refuses a secret file that is not a regular file
owned by this user (or root) or that its group or others may read or write (``chmod 600``,
ssh's rule for a private key), and a secret (file or environment) that is guessable by its
shape: fewer than 16 characters, fewer than 8 distinct ones, or under 64 bits by a
per-character Shannon estimate (length x entropy of its character frequencies). The estimate
catches repetition and tiny alphabets, not a dictionary phrase: make one with
``openssl rand -hex 32``.

**API keys.** The router's client gRPC API takes the same keys as the REST gateway, as
``authorization: Bearer <key>`` metadata (`api_key_check`).

grpc.health.v1 stays open on every server (probes carry no credentials), within bounds: a
caller without credentials holds at most `MAX_OPEN_CALLS` health calls at once between all
such callers, and each must send its request within `OPEN_READ_TIMEOUT_S`, so probes that
never finish cannot take the server's concurrent-call slots (`transport.new_server`) from
authenticated callers.

**Refusals cost little and log little.** A refused call is answered before its request is
read (the bytes of its message are never buffered or parsed, and a caller who never sends
one holds nothing), and the WARNING it logs is rate-limited (`pdserve.ratelog`): one line per
refusal reason per `REFUSAL_LOG_INTERVAL_S`, with the count of the calls it stands for.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import inspect
import math
import os
from collections import Counter
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import structlog

from pdserve.errors import ErrorCode
from pdserve.private_file import read_private_text
from pdserve.ratelog import RateLimitedLog
from pdserve.rpc.errors import ERROR_CODE_KEY, Continuation, MethodHandler
from pdserve.rpc.metadata import metadata_value

log = structlog.get_logger(__name__)

CLUSTER_SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
CLUSTER_TOKEN_KEY = "x-pdserve-cluster-token"  # call metadata: hex HMAC(secret, "grpc")
AUTHORIZATION_KEY = "authorization"  # call metadata: "Bearer <api key>"
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
MIN_SECRET_CHARS = 16
MIN_SECRET_DISTINCT_CHARS = 8
MIN_SECRET_BITS = 64.0  # Shannon estimate, see the module docstring
# Open (health) calls from callers without credentials: how many at once, between all of
# them (probes come one per period), and how long each may take to send its request.
MAX_OPEN_CALLS = 16
OPEN_READ_TIMEOUT_S = 5.0
REFUSAL_LOG_INTERVAL_S = 30.0  # one "grpc_call_unauthenticated" line per reason this often

Metadata = Iterable[tuple[str, Any]] | None
Check = Callable[[Metadata], str | None]  # metadata -> None (accepted) or the refusal message


@dataclass(frozen=True)
class ClusterSecret:
    """The shared secret of one cluster; `repr` never shows it."""

    value: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.value) < MIN_SECRET_CHARS:
            raise ValueError(f"the cluster secret must be at least {MIN_SECRET_CHARS} "
                             f"characters long, got {len(self.value)}")

    def derive(self, purpose: str) -> bytes:
        """The key for one purpose: HMAC-SHA256(secret, "pdserve/" + purpose)."""
        return hmac.new(self.value, f"pdserve/{purpose}".encode(), hashlib.sha256).digest()

    @property
    def grpc_token(self) -> str:
        return self.derive("grpc").hex()

    @property
    def kv_key(self) -> bytes:
        return self.derive("kv-write")

    def grpc_metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata that authenticates a router (or any cluster member) to a worker."""
        return ((CLUSTER_TOKEN_KEY, self.grpc_token),)


def load_cluster_secret(path: str | os.PathLike[str] | None = None,
                        env: Mapping[str, str] | None = None) -> ClusterSecret | None:
    """The secret from the file at `path` (surrounding whitespace dropped), else from
    ``PDSERVE_CLUSTER_SECRET``, else None. ValueError (never quoting the secret) for an
    unreadable, empty or group/world-accessible file, or a weak secret (module docstring)."""
    if path:
        raw = _read_secret_file(Path(path))
    else:
        raw = (os.environ if env is None else env).get(CLUSTER_SECRET_ENV, "").strip()
        if not raw:
            return None
    problem = secret_weakness(raw)
    if problem:
        where = f"the cluster secret file {path}" if path else CLUSTER_SECRET_ENV
        raise ValueError(f"{where}: {problem}; make one with `openssl rand -hex 32`")
    return ClusterSecret(raw.encode())


def _read_secret_file(path: Path) -> str:
    raw = read_private_text(path, "the cluster secret file").strip()
    if not raw:
        raise ValueError(f"the cluster secret file {path} is empty")
    return raw


def secret_bits(secret: str) -> float:
    """Length x the Shannon entropy of the secret's character frequencies: an upper bound
    on the bits a generator of random characters put in it (0 for ``"aaaa..."``)."""
    n = len(secret)
    return -sum(c * math.log2(c / n) for c in Counter(secret).values()) if n else 0.0


def secret_weakness(secret: str) -> str | None:
    """Why `secret` is too guessable to be a cluster secret, or None."""
    if len(secret) < MIN_SECRET_CHARS:
        return f"too short ({len(secret)} characters, at least {MIN_SECRET_CHARS} needed)"
    distinct = len(set(secret))
    if distinct < MIN_SECRET_DISTINCT_CHARS:
        return (f"too few distinct characters ({distinct}, at least "
                f"{MIN_SECRET_DISTINCT_CHARS} needed)")
    bits = secret_bits(secret)
    if bits < MIN_SECRET_BITS:
        return (f"too little entropy (about {bits:.0f} bits by its character frequencies, at "
                f"least {MIN_SECRET_BITS:.0f} needed)")
    return None


_warned: set[str] = set()


def warn_unauthenticated(secret: ClusterSecret | None, component: str) -> None:
    """Log once per process and component that internal traffic is not authenticated."""
    if secret is None and component not in _warned:
        _warned.add(component)
        log.warning("cluster_auth_disabled", component=component,
                    detail="no cluster secret (--cluster-secret-file / "
                    f"{CLUSTER_SECRET_ENV}): internal gRPC calls and KV writes are not "
                    "authenticated; bind internal ports to loopback or a private network only")


def warn_no_api_keys(keys: Collection[str], component: str) -> None:
    """Log once per process and component that the client API (REST and gRPC) is open."""
    key = f"api:{component}"
    if not keys and key not in _warned:
        _warned.add(key)
        log.warning("api_auth_disabled", component=component,
                    detail="no API keys (--api-key / PDSERVE_API_KEY): every client may call "
                    "the REST and gRPC API; keep it on loopback")


def warn_insecure_listener(component: str, host: str, missing: Collection[str]) -> None:
    """The loud start-up line of a process told `--insecure`: it listens off loopback
    without the credentials named in `missing`."""
    log.warning("INSECURE_LISTENER", component=component, host=host, missing=sorted(missing),
                detail=f"--insecure: listening on {host} without {' and '.join(missing)}; "
                "anyone who can reach this address can use it. Never run this way on a "
                "network you do not control")


# --------------------------------------------------------------------------- gRPC checks


def cluster_token_check(secret: ClusterSecret) -> Check:
    """Accepts calls carrying this cluster's token."""
    expected = secret.grpc_token.encode()

    def check(metadata: Metadata) -> str | None:
        token = metadata_value(metadata, CLUSTER_TOKEN_KEY)
        if token is None:
            return f"missing cluster credential ({CLUSTER_TOKEN_KEY} metadata)"
        if not hmac.compare_digest(token.encode(), expected):
            return "wrong cluster credential"
        return None

    return check


def api_key_check(keys: Collection[str]) -> Check:
    """Accepts ``authorization: Bearer <key>`` with one of `keys` (the REST gateway's rule)."""
    accepted = [k.encode() for k in keys]

    def check(metadata: Metadata) -> str | None:
        scheme, _, token = (metadata_value(metadata, AUTHORIZATION_KEY) or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "missing API key: send 'authorization: Bearer <key>' metadata"
        given = token.strip().encode()
        # Compare against every key so timing does not reveal which one nearly matched.
        if not any([hmac.compare_digest(given, k) for k in accepted]):
            return "incorrect API key provided"
        return None

    return check


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call `check` rejects with UNAUTHENTICATED (trailer ``pdserve-error-code:
    unauthenticated``) before its handler runs or its request is read; methods under
    `open_prefixes` (grpc.health.v1) pass unchecked, bounded as the module docstring says
    when the caller has no credentials. Give it to `transport.new_server(auth=...)`, which
    puts it before every other interceptor."""

    def __init__(self, check: Check, *, what: str,
                 open_prefixes: tuple[str, ...] = OPEN_METHOD_PREFIXES,
                 max_open_calls: int = MAX_OPEN_CALLS,
                 open_read_timeout_s: float = OPEN_READ_TIMEOUT_S,
                 log_interval_s: float = REFUSAL_LOG_INTERVAL_S) -> None:
        self._check = check
        self._what = what
        self._open = open_prefixes
        self._open_calls = _OpenCalls(max_open_calls, open_read_timeout_s)
        self.refusals = RateLimitedLog(log, "grpc_call_unauthenticated",
                                       interval_s=log_interval_s)

    async def intercept_service(
        self,
        continuation: Continuation,
        handler_call_details: grpc.HandlerCallDetails,
    ) -> MethodHandler | None:
        method = handler_call_details.method
        problem = self._check(handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if problem is None or handler is None:  # None: unknown method, grpc answers UNIMPLEMENTED
            return handler
        if method.startswith(self._open):
            return self._open_calls.bound(handler)
        self.refusals(problem, method=method, credential=self._what, reason=problem)
        return _refusing(handler, problem)


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler that aborts at once, reading no request: a request-streaming one whatever
    `handler` is, since grpc reads a unary request before it calls the handler (a caller
    that never sent it would hold the call open), and with no deserializer."""
    trailers = ((ERROR_CODE_KEY, str(ErrorCode.UNAUTHENTICATED)),)

    async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message, trailing_metadata=trailers)

    return grpc.stream_stream_rpc_method_handler(
        refuse, response_serializer=handler.response_serializer)


class _OpenCalls:
    """Open methods' calls from callers without credentials: at most `limit` at once
    (more: RESOURCE_EXHAUSTED at once), each request read within `read_timeout_s` (else
    DEADLINE_EXCEEDED). The handler is made request-streaming, so it runs (and counts) from
    the call's start rather than from its request's arrival."""

    def __init__(self, limit: int, read_timeout_s: float) -> None:
        self.limit = limit
        self.read_timeout_s = read_timeout_s
        self.active = 0  # one event loop: no lock

    def bound(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        kw = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
        if handler.unary_unary:
            unary: Any = handler.unary_unary  # typed for the sync context by grpc's stubs

            async def call(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                async with self._slot(requests, context) as request:
                    return await unary(request, context)

            return grpc.stream_unary_rpc_method_handler(call, **kw)
        if handler.unary_stream:
            stream: Any = handler.unary_stream

            async def stream_call(requests: Any, context: grpc.aio.ServicerContext) -> None:
                async with self._slot(requests, context) as request:
                    result = stream(request, context)
                    if inspect.isasyncgen(result):
                        async for message in result:
                            await context.write(message)
                    elif inspect.isawaitable(result):
                        await result

            return grpc.stream_stream_rpc_method_handler(stream_call, **kw)
        return handler  # request-streaming open methods: none (grpc.health.v1 has none)

    @contextlib.asynccontextmanager
    async def _slot(self, requests: Any,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if self.active >= self.limit:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"more than {self.limit} unauthenticated calls at once")
        self.active += 1
        try:
            try:
                async with asyncio.timeout(self.read_timeout_s):
                    request = await anext(aiter(requests))
            except TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"no request within {self.read_timeout_s:g} s")
            except StopAsyncIteration:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no request message")
            yield request
        finally:
            self.active -= 1


def cluster_interceptor(secret: ClusterSecret | None) -> AuthInterceptor | None:
    """The interceptor a worker's gRPC server runs: the cluster token, or None (open)."""
    if secret is None:
        return None
    return AuthInterceptor(cluster_token_check(secret), what="cluster")


def api_key_interceptor(keys: Collection[str]) -> AuthInterceptor | None:
    """The interceptor of the router's client API: the API keys, or None (no keys: open)."""
    if not keys:
        return None
    return AuthInterceptor(api_key_check(keys), what="api_key")
