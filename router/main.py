"""Router process: the Router, its gRPC API and the OpenAI-compatible HTTP gateway, all in
one event loop (no extra network hop on the token path). Its config, `RouterProcessConfig`,
is in router.config."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import structlog

from pdserve.control.registry import WorkerRegistry
from pdserve.control.signing import signer_for
from pdserve.engine.config import ModelConfig
from pdserve.engine.model_store import model_id, resolve_model
from pdserve.engine.tokenizer import Tokenizer
from pdserve.rpc import auth, transport
from pdserve.service import Drain, serving
from pdserve.tenants import Tenants
from router import servicer
from router.clients import WorkerChannels
from router.config import RouterProcessConfig
from router.router import Router
from router.timings import ArrivalInterceptor

log = structlog.get_logger(__name__)
SERVICE = "pdserve.v1.Router"


@dataclass
class RouterAddresses:
    grpc: str = ""
    http: str = ""


async def run_router(config: RouterProcessConfig, stop: asyncio.Event,
                     ready: asyncio.Event | None = None,
                     addresses: RouterAddresses | None = None) -> None:
    model_dir = resolve_model(config.model)
    tokenizer = Tokenizer(model_dir)
    model_config = ModelConfig.from_dir(model_dir)
    model_name = config.served_model_name or model_dir.name
    addresses = addresses if addresses is not None else RouterAddresses()
    secret = config.cluster_secret
    auth.warn_unauthenticated(secret, "router")
    tls = config.tls
    compiled = config.data_plane == "compiled"
    if compiled:
        from router import dataplane
        if not dataplane.available():
            raise ValueError("--data-plane compiled: the extension router/_dataplane.cc is not "
                             "built here (it needs grpc++'s headers, Debian's libgrpc++-dev, "
                             "when the package is installed)")
    channels = WorkerChannels(() if secret is None else secret.grpc_metadata(), tls=tls,
                              sessions=config.worker_sessions)
    # Only workers whose records are signed under the cluster secret, serving these weights,
    # are ever listed: they alone get prompts, requests and the cluster token.
    signer = signer_for(secret, config.namespace)
    async with (WorkerRegistry.from_url(config.redis_url, namespace=config.namespace,
                                        signer=signer) as reg,
                Router(reg, tokenizer, model_name=model_name,
                       max_model_len=model_config.max_position_embeddings,
                       config=config.router, channels=channels,
                       model_id=model_id(model_dir)) as router):
        # One set of tenants for both APIs, so a key's quota spans REST and gRPC.
        tenants = Tenants(config.api_keys, config.key_policies)
        server = transport.new_server(max_message_bytes=config.max_request_bytes,
                                      auth=auth.api_key_interceptor(tenants.keys),
                                      stamp=ArrivalInterceptor())
        rpc = servicer.add_to_server(router, server, tenants)
        plane = None
        if compiled:
            plane = rpc.resumes = dataplane.CompiledDataPlane(
                router, rpc, tenants,
                worker_metadata=() if secret is None else secret.grpc_metadata(),
                max_message_bytes=config.max_request_bytes, tls=tls)
        # With the compiled data plane, the grpc.aio server listens on loopback only: the
        # data plane relays to it what it does not route itself.
        async with serving("router", server, SERVICE,
                           "127.0.0.1" if plane is not None else config.host,
                           0 if plane is not None else config.grpc_port,
                           None if tls is None else tls.server_credentials(tls.client_auth)
                           ) as service:
            addresses.grpc = service.bound
            if plane is not None:
                addresses.grpc = plane.start(config.host, config.grpc_port, service.bound)
            http_task = None
            http_server = None
            if config.http_port is not None:
                from pdserve.gateway.app import GatewayConfig, create_app
                from pdserve.gateway.server import make_server

                app = create_app(router, GatewayConfig(
                    api_keys=config.api_keys, key_policies=config.key_policies,
                    metrics_require_auth=config.metrics_require_auth,
                    max_body_bytes=config.max_request_bytes, served_model_name=model_name),
                    tenants=tenants)
                http_server = make_server(app, host=config.host, port=config.http_port, tls=tls)
                http_task = asyncio.create_task(http_server.serve())
                while not http_server.started:
                    if http_task.done():
                        http_task.result()
                    await asyncio.sleep(0.05)
                port = http_server.servers[0].sockets[0].getsockname()[1]
                addresses.http = f"{'http' if tls is None else 'https'}://{config.host}:{port}"

            async def drain_http(budget_s: float) -> None:
                async def http() -> None:
                    if http_server is not None and http_task is not None:
                        http_server.should_exit = True
                        with contextlib.suppress(Exception):
                            await asyncio.wait_for(http_task, budget_s)

                # The data plane relays to the grpc.aio server: it stops before that does.
                await asyncio.gather(http(), *([plane.stop(budget_s)] if plane else []))

            # One drain budget for both APIs, so a stop signal ends the process within it.
            await service.run(stop, ready, Drain(config.drain_timeout_s, drain_http),
                              ready_fields=dict(grpc=addresses.grpc, http=addresses.http or None,
                                                tls=None if tls is None else tls.client_auth))
    log.info("router_stopped")


__all__ = ["RouterAddresses", "RouterProcessConfig", "run_router"]
