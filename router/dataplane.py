"""The router's compiled data plane, Python's side: every decision
(docs/design/compiled_data_plane.md).

`router/_dataplane.cc` (grpc++) serves the client-facing gRPC API on the router's port. It
reads each Generate call's request with the prompt's token ids apart (handed over as a tuple
of shared int objects: nothing parses or copies thousands of ids in Python) and Python
decides on it at once, on the grpc thread that read it, while the event loop is parked: the
loop's selector tells the extension when the loop waits in it and when it leaves
(`_ParkingSelector`), so a decision runs only while the loop runs no Python, and the loop
none while a decision runs or waits. Decisions need no thread switch and no wake-up of the
loop, and the router's state is touched by one thread at a time, as with the loop alone.
(Where the loop's selector cannot be wrapped, each request is an event on the loop instead.)
A request gets what the grpc.aio servicer gives it: the API key and its tenant, the
request's checks, the tenant's quota, admission, placement and the ledger entry (the very
same code). Then:

- a local route with token ids for a prompt: the extension sends the request on that decode
  worker's Session (the prompt's ids spliced in as the client sent them) and relays each
  chunk to the client as a GenerateResponse, with no Python per token (the last one with
  its StageTimings, timed there, when asked for). Python hears of it again, through events
  an eventfd wakes the loop for: at its first token (admission learns, the ledger's charge
  ends, the router's own time is observed: `pdserve_router_overhead_seconds`, timed in C++
  from the request read to its message handed to grpc, and from the worker's first chunk
  read to the client's response handed to grpc) and at its end (the ledger, admission and
  the quota let go);
- a text or chat prompt: tokenized off the loop (in a thread, as the grpc.aio servicer
  does it), then decided on the loop as a token-id prompt is, Python writing the prompt's
  ids into the worker's message;
- a remote prefill: placed here and entered in the ledger, then handed to the grpc.aio
  server with a one-use token (`RESUME_KEY`, as below): it runs the allocation, the prefill
  and the decode stream on that placement, neither tokenizing, admitting nor placing the
  request again (the extension relays that call: a second hop);
- a refusal by the tenant's quota or admission, or a text or chat prompt the servicer's
  checks refuse: the call ends there, with the status and trailers the grpc.aio server
  would have sent;
- everything else (a bad key or request, a call with ``x-request-id`` metadata) is relayed
  by the extension to the router's grpc.aio server on a loopback port, which serves it as
  it always has.

When a routed request's worker fails it (an error from the worker, the session's end, no
chunk within the request's timeouts), Python decides again: the call is relayed to the
grpc.aio server with a one-use resume token (`RESUME_KEY`), and the servicer goes on with the
request there (`router.router.Resumed`): retried on another worker before its first token,
migrated after it, the tokens the client has kept; or the worker's error, reported as the
grpc.aio server reports it. A silent stream has its worker probed (`Liveness.stalled`), and a
worker declared lost has its session ended, as on the Python path.

With TLS (`--tls-cert`), the extension serves the client-facing port with the router's
certificate (client certificates as `--tls-client-auth` says) and dials the workers and the
grpc.aio server behind it with mTLS, as the router's Python clients do.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import selectors
import time
import types
import uuid
from collections.abc import Iterable

import structlog
from prometheus_client import Counter

from pdserve.control.workers import WorkerInfo
from pdserve.errors import (
    OverloadedError,
    PdserveError,
    WorkerTimeoutError,
)
from pdserve.rpc import convert, transport
from pdserve.rpc.errors import error_from_status, refusal
from pdserve.rpc.tls import TLSConfig
from pdserve.tenants import Lease, Tenant, Tenants
from pdserve.types import GenerateRequest, LatencyClass, check_request_id
from pdserve.v1 import common_pb2, router_pb2
from router.admission import Ticket
from router.policy import Decision, Route
from router.router import Resumed, Router
from router.servicer import RESUME_KEY, Handback, RouterServicer

_dataplane: types.ModuleType | None
try:
    from router import _dataplane
except ImportError:  # not built: no grpc++ headers where the package was installed
    _dataplane = None

log = structlog.get_logger(__name__)

GENERATE = "/pdserve.v1.Router/Generate"
# How long a handed-back request waits for its relayed call to claim it.
HANDBACK_TTL_S = 30.0
_CALL, _FIRST, _END, _FAILED, _STALLED = range(5)


def available() -> bool:
    """Whether the extension (router/_dataplane.cc) was built here."""
    return _dataplane is not None


@dataclasses.dataclass(slots=True)
class _Routed:
    """A request the data plane is streaming from a decode worker."""

    request: GenerateRequest
    label: str
    lease: Lease
    ticket: Ticket
    decode: WorkerInfo
    decision: Decision
    routed_at: float  # time.monotonic()
    logged: bool = False


class CompiledDataPlane:
    """Serves the client-facing gRPC API through router/_dataplane.cc (module docstring).
    One per process: `start` it once the grpc.aio server it relays to is listening, `stop` it
    (in a thread: it waits for calls) before that server stops."""

    def __init__(self, router: Router, servicer: RouterServicer, tenants: Tenants, *,
                 worker_metadata: Iterable[tuple[str, str]] = (),
                 max_message_bytes: int = transport.MAX_MESSAGE_BYTES,
                 tls: TLSConfig | None = None) -> None:
        if _dataplane is None:
            raise RuntimeError("the compiled data plane is not built here (router/_dataplane"
                               ".cc needs grpc++'s headers: Debian's libgrpc++-dev)")
        self.router = router
        self.servicer = servicer
        self.tenants = tenants
        self._worker_metadata = tuple(worker_metadata)
        self._max_message_bytes = max_message_bytes
        self._tls = tls
        self._routed: dict[int, _Routed] = {}
        self._handbacks: dict[str, tuple[Handback, asyncio.TimerHandle]] = {}
        self._efd = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Future[None]] = set()  # text and chat prompts tokenized
        cfg = router.config
        # A routed request's first-token timeout by latency class: the router's, capped by
        # the class's deadline where admission runs (`Router._generate`'s).
        self._first_timeouts = {
            c: min(cfg.first_token_timeout_s,
                   cfg.admission.deadline_s(c) * cfg.admission.first_token_deadline_factor)
            if cfg.admission.enabled else cfg.first_token_timeout_s for c in LatencyClass}
        self.calls = Counter(
            "pdserve_router_data_plane_calls", "Generate calls the compiled data plane took, "
            "by what became of them: routed (relayed to a decode worker with no Python per "
            "token), remote (placed for a remote prefill, which the grpc.aio server runs "
            "as placed), relayed (served by the grpc.aio server), refused (by the quota, "
            "admission or the request's checks), handed_back (their worker failed them: the "
            "grpc.aio server goes on with them)", ["path"], registry=router.metrics_registry)
        self._paths = {p: self.calls.labels(p)
                       for p in ("routed", "remote", "relayed", "refused", "handed_back")}

    # ------------------------------------------------------------------ lifecycle

    def start(self, host: str, port: int, internal: str) -> str:
        """Listen on ``host:port`` (0: any free port), relaying to the grpc.aio server at
        `internal`; returns the address it listens on."""
        assert _dataplane is not None
        bound_port, self._efd = _dataplane.start(
            f"{host}:{port}", internal, list(self._worker_metadata),
            _int_options(transport.channel_options(max_message_bytes=self._max_message_bytes)),
            _int_options(transport.server_options(max_message_bytes=self._max_message_bytes)),
            self._max_message_bytes,
            None if (t := self._tls) is None else (
                t.cert_pem, t.key_pem, t.ca_pem, t.client_auth == "require",
                t.server_name or ""))
        self._loop = loop = asyncio.get_running_loop()
        loop.add_reader(self._efd, self._drain)
        # Decisions on grpc's thread while the loop is parked (router/_dataplane.cc's
        # handoff): where the loop's selector can report it; else each request is an event.
        selector = getattr(loop, "_selector", None)
        if isinstance(loop, asyncio.SelectorEventLoop) and selector is not None:
            loop._selector = _ParkingSelector(selector)  # type: ignore[attr-defined]
            _dataplane.handoff(self._decide_now)
        self.router.liveness.on_lost.append(self._lost)
        return f"{host}:{bound_port}"

    async def stop(self, grace_s: float) -> None:
        """Take no more calls; give those in flight `grace_s` to finish, then cancel them."""
        assert _dataplane is not None
        await asyncio.to_thread(_dataplane.stop, grace_s)
        _dataplane.handoff(None)
        for task in list(self._tasks):  # their calls have ended with the server
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        loop = asyncio.get_running_loop()
        selector = getattr(loop, "_selector", None)
        if isinstance(selector, _ParkingSelector):
            loop._selector = selector.inner  # type: ignore[attr-defined]
        self._drain()
        loop.remove_reader(self._efd)

    def _lost(self, w: WorkerInfo) -> None:
        assert _dataplane is not None
        if w.role == "decode":
            _dataplane.drop(w.grpc_address)  # its requests come back as failed: placed again

    # ------------------------------------------------------------------ events

    def _drain(self) -> None:
        assert _dataplane is not None
        with contextlib.suppress(BlockingIOError):
            os.read(self._efd, 8)
        for event in _dataplane.take():
            try:
                kind = event[0]
                if kind == _CALL:
                    self._arrived(*event[1])
                elif kind == _FIRST:
                    self._first(*event[1:])
                elif kind == _END:
                    self._end(*event[1:])
                elif kind == _FAILED:
                    self._failed(*event[1:])
                elif kind == _STALLED:
                    if (routed := self._routed.get(event[1])) is not None:
                        self.router.liveness.stalled(routed.decode)
            except Exception:  # one request's bug must not stall every other
                log.exception("data_plane_event_failed", kind=event[0], call=event[1])

    def _decide_now(self, call: int, body: bytes, auth: bytes, request_id_metadata: int,
                    ids: tuple[int, ...] | None, packed: bytes | None) -> None:
        """`_arrived`, on grpc's thread with the loop parked (the extension's handoff)."""
        assert _dataplane is not None
        try:
            self._arrived(call, body, auth, request_id_metadata, ids, packed)
        except Exception:  # never into the extension: the grpc.aio server serves it
            log.exception("data_plane_decision_failed", call=call)
            _dataplane.relay(call, "")

    def _arrived(self, call: int, body: bytes, auth: bytes, request_id_metadata: int,
                 ids: tuple[int, ...] | None, packed: bytes | None) -> None:
        assert _dataplane is not None
        try:
            taken = self._decide(call, body, auth.decode(errors="replace"),
                                 bool(request_id_metadata), ids, packed)
        except OverloadedError as exc:
            self._refuse(call, exc)
            return
        if not taken:
            self._relay(call)

    def _refuse(self, call: int, exc: Exception) -> None:
        """End `call` with `exc` as the grpc.aio server would (`refusal`)."""
        assert _dataplane is not None
        status, message, trailers = refusal(exc, GENERATE)
        if _dataplane.refuse(call, status.value[0], message, list(trailers)):
            self._paths["refused"].inc()

    def _relay(self, call: int) -> None:
        """Leave `call` to the grpc.aio server, as the client sent it."""
        assert _dataplane is not None
        _dataplane.relay(call, "")
        self._paths["relayed"].inc()

    def _decide(self, call: int, body: bytes, auth: str, request_id_metadata: bool,
                ids: tuple[int, ...] | None, packed: bytes | None) -> bool:
        """Take `call` (True: routed, handed back placed, or its text or chat prompt being
        tokenized, to be decided on the loop: `_tokenized`), or leave it to the grpc.aio
        server (False). `body` is its request, with its prompt's token ids apart (`ids`;
        None where the request has none, or they did not parse; `packed`: the same as
        native int32s, which placement hashes). OverloadedError: its tenant's quota or
        admission refused it."""
        if request_id_metadata:
            return False  # its checks and echo are the grpc.aio server's (ErrorInterceptor)
        try:
            request = router_pb2.GenerateRequest.FromString(body)
        except Exception:  # protobuf's DecodeError: the grpc.aio server says what is wrong
            return False
        # Token ids the extension read, or a prompt to tokenize; anything else is relayed.
        if request.WhichOneof("input") not in (("token_ids",) if ids is not None
                                               else ("text", "chat")):
            return False
        scheme, _, key = auth.partition(" ")
        tenant = self.tenants.identify(key.strip() if scheme.lower() == "bearer" else None)
        if tenant is None:
            return False  # refused there, as every wrong key is
        label = request.request_id or f"req-{uuid.uuid4().hex}"
        try:
            check_request_id(label)
        except PdserveError:
            return False
        lease = self.tenants.admit(tenant)  # QuotaExceededError, an OverloadedError: refused
        if ids is None:  # text or chat: tokenized off the loop, then decided on it
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._tokenize, call, request, label, tenant, lease)
            return True
        try:
            req = self.servicer.token_request(request, label, tenant, ids)
        except Exception:
            lease.release()
            return False
        return self._place(call, request, label, lease, req, spliced=True,
                           hash_ids=None if packed is None else memoryview(packed).cast("i"))

    def _tokenize(self, call: int, request: router_pb2.GenerateRequest, label: str,
                  tenant: Tenant, lease: Lease) -> None:
        task = asyncio.ensure_future(self._tokenized(call, request, label, tenant, lease))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _tokenized(self, call: int, request: router_pb2.GenerateRequest, label: str,
                         tenant: Tenant, lease: Lease) -> None:
        """A text or chat prompt's call: tokenized off the loop (as the grpc.aio servicer
        does), then placed as a token-id prompt is, its ids written by Python."""
        try:
            req = await self.servicer.tokenized_request(request, label, tenant)
        except PdserveError as exc:  # an invalid request: the servicer's error
            lease.release()
            self._refuse(call, exc)
            return
        except Exception:
            lease.release()
            log.exception("data_plane_tokenize_failed", call=call)
            self._relay(call)
            return
        except BaseException:
            lease.release()
            raise
        try:
            if not self._place(call, request, label, lease, req, spliced=False):
                self._relay(call)
        except OverloadedError as exc:
            self._refuse(call, exc)
        except Exception:  # one request's bug: the grpc.aio server serves it
            log.exception("data_plane_decision_failed", call=call)
            self._relay(call)

    def _place(self, call: int, request: router_pb2.GenerateRequest, label: str,
               lease: Lease, req: GenerateRequest, *, spliced: bool,
               hash_ids: memoryview | None = None) -> bool:
        """Admit and place `req` (`call`'s, holding `lease`); route it to its decode worker,
        or hand it to the grpc.aio server placed (a remote prefill): True. False where
        something failed that the grpc.aio server reports (having released what it held).
        `spliced`: the extension splices the client's token ids into the worker's message
        (else Python writes the prompt: a tokenized one); `hash_ids`: those ids as native
        int32s, for placement. OverloadedError: admission refused it."""
        assert _dataplane is not None
        router = self.router
        try:
            ticket = router.admit(req)
        except OverloadedError:
            lease.release()
            raise
        except Exception:
            lease.release()
            return False
        try:
            chosen, cpu_s = router.choose(req, hash_ids=hash_ids)
        except Exception:
            router.admission.release(ticket)
            lease.release()
            return False
        decode, decision = chosen.decode, chosen.decision
        if decision.route is not Route.LOCAL:
            # A remote prefill: the grpc.aio server streams it, on this very placement
            # (entered now, before anything else is placed), neither tokenized nor
            # admitted nor placed again.
            router.enter(req, chosen, cpu_s)
            self._hand_back(call, Handback(req, label, lease, Resumed(ticket, placed=chosen)),
                            "remote")
            return True
        placed_at = time.monotonic()
        msg = common_pb2.GenerateInput()
        convert.fill_input(msg, req, prompt=not spliced)
        cfg = router.config
        if not _dataplane.route(call, decode.grpc_address, msg.SerializeToString(), label,
                                decode.worker_id, self._first_timeouts[req.latency_class],
                                cfg.token_timeout_s, cfg.liveness.stall_probe_s,
                                request.return_timings):
            router.admission.release(ticket)  # the client left while it was decided
            lease.release()
            return True
        # The request is on its way: the rest is not, its ledger entry included (nothing
        # else is placed before this returns). Its events come through the loop, which runs
        # nothing before this returns either.
        router.enter(req, chosen, cpu_s)
        self._routed[call] = _Routed(req, label, lease, ticket, decode, decision, placed_at)
        router.metrics.decided(decision.route.value, decision.reason)
        self._paths["routed"].inc()
        return True

    def _first(self, call: int, in_s: float, out_s: float, token: int) -> None:
        routed = self._routed.get(call)
        if routed is None:
            return
        router = self.router
        now = time.monotonic()
        router.admission.first_token(routed.ticket, now)
        if router.ledger.charged(routed.request.request_id):  # its prompt is prefilled
            router.ledger.charge(routed.request.request_id, None, 0)
        if token:
            router.first_token(routed.decision, now - routed.routed_at)
        parts = router.metrics.overhead_parts
        parts[0].observe(in_s)
        parts[1].observe(out_s)
        parts[2].observe(in_s + out_s)
        self._log(routed)

    def _end(self, call: int, finished: int) -> None:
        routed = self._routed.pop(call, None)
        if routed is not None:
            self._release(routed)

    def _failed(self, call: int, status: int, message: bytes, code: bytes, param: bytes,
                streamed: list[int]) -> None:
        assert _dataplane is not None
        routed = self._routed.pop(call, None)
        if routed is None:
            return
        self._log(routed)
        self.router.ledger.release(routed.request.request_id)
        text, why = message.decode(errors="replace"), code.decode(errors="replace")
        error: BaseException
        if why == "worker_timeout":  # the extension's own deadline (WorkerTimeoutError's)
            error = WorkerTimeoutError(text)
        else:
            error = error_from_status(status, text, why or None,
                                      param.decode(errors="replace") or None)
        self._hand_back(call, Handback(routed.request, routed.label, routed.lease, Resumed(
            routed.ticket, routed.decode.worker_id, error, tuple(streamed))), "handed_back")

    def _hand_back(self, call: int, handback: Handback, path: str) -> None:
        """Relay `call` to the grpc.aio server with a one-use token that claims `handback`
        there (`claim`)."""
        assert _dataplane is not None and self._loop is not None
        token = secrets.token_urlsafe(24)
        expiry = self._loop.call_later(HANDBACK_TTL_S, self._expire, token)
        self._handbacks[token] = (handback, expiry)
        if _dataplane.relay(call, token):
            self._paths[path].inc()
        else:  # the client left meanwhile
            self._expire(token)

    def _expire(self, token: str) -> None:
        """A handed-back request no call claimed: let go of what it holds."""
        entry = self._handbacks.pop(token, None)
        if entry is not None:
            handback, expiry = entry
            expiry.cancel()
            self.router.ledger.release(handback.request.request_id)  # a placed one's entry
            self.router.admission.release(handback.resumed.ticket)
            handback.lease.release()

    def claim(self, token: str) -> Handback | None:
        """The request handed back under `token`, once (`router.servicer.Resumes`)."""
        entry = self._handbacks.pop(token, None)
        if entry is None:
            return None
        handback, expiry = entry
        expiry.cancel()
        return handback

    def _release(self, routed: _Routed) -> None:
        self._log(routed)
        self.router.ledger.release(routed.request.request_id)
        self.router.admission.release(routed.ticket)
        routed.lease.release()

    def _log(self, routed: _Routed) -> None:
        """The request's route_decision line, once (off its way to the first token)."""
        if routed.logged:
            return
        routed.logged = True
        d = routed.decision
        log.info("route_decision", request_id=routed.request.request_id, route=d.route.value,
                 reason=d.reason, uncached_tokens=d.uncached_tokens,
                 prompt_tokens=len(routed.request.prompt_token_ids), resumed_tokens=0,
                 decode=routed.decode.worker_id, prefill=None,
                 latency_class=routed.request.latency_class.value,
                 predicted_ttft_s=d.predicted_ttft_s, data_plane="compiled")


class _ParkingSelector:
    """The event loop's selector, telling router/_dataplane.cc when the loop parks in it and
    when it leaves (`loop_idle`, `loop_busy`): decisions run on grpc's thread in between,
    while the loop runs no Python (`CompiledDataPlane` installs it)."""

    def __init__(self, inner: selectors.BaseSelector) -> None:
        self.inner = inner

    def select(self, timeout: float | None = None
               ) -> list[tuple[selectors.SelectorKey, int]]:
        assert _dataplane is not None
        _dataplane.loop_idle()
        try:
            return self.inner.select(timeout)
        finally:
            _dataplane.loop_busy()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def _int_options(options: Iterable[tuple[str, object]]) -> list[tuple[str, int]]:
    """The grpc options the extension takes (integers: all of `pdserve.rpc.transport`'s)."""
    return [(name, value) for name, value in options if isinstance(value, int)]


__all__ = ["GENERATE", "RESUME_KEY", "CompiledDataPlane", "available"]
