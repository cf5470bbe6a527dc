"""Router process: the Router, its gRPC API and the OpenAI-compatible HTTP gateway, all in
one event loop (no extra network hop on the token path)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import structlog

from control.registry import WorkerRegistry
from engine.config import ModelConfig
from engine.model_store import resolve_model
from engine.tokenizer import Tokenizer
from pdserve import grpc_util as gu
from pdserve.runtime import start_server
from pdserve.v1 import router_pb2_grpc
from router.router import Router, RouterConfig
from router.servicer import RouterServicer

log = structlog.get_logger(__name__)
SERVICE = "pdserve.v1.Router"


@dataclass(frozen=True)
class RouterProcessConfig:
    redis_url: str
    model: str | None = None
    namespace: str = "default"
    host: str = "127.0.0.1"
    grpc_port: int = 0
    http_port: int | None = None  # None: no HTTP gateway
    api_keys: frozenset[str] = frozenset()
    # The largest request either API takes: an HTTP body (else 413) or a gRPC message (else
    # RESOURCE_EXHAUSTED), so a prompt too big for one is too big for the other.
    max_request_bytes: int = 1 << 20
    router: RouterConfig = field(default_factory=RouterConfig)
    drain_timeout_s: float = 30.0


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
    addresses = addresses if addresses is not None else RouterAddresses()
    async with (WorkerRegistry.from_url(config.redis_url, namespace=config.namespace) as reg,
                Router(reg, tokenizer, model_name=model_dir.name,
                       max_model_len=model_config.max_position_embeddings,
                       config=config.router) as router):
        server = gu.new_server(max_message_bytes=config.max_request_bytes)
        router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(router), server)
        health = await gu.add_health(server, SERVICE)
        addresses.grpc = await start_server(server, config.host, config.grpc_port)
        http_task = None
        http_server = None
        if config.http_port is not None:
            from gateway.app import GatewayConfig, create_app
            from gateway.server import make_server

            app = create_app(router, GatewayConfig(api_keys=config.api_keys,
                                                   max_body_bytes=config.max_request_bytes,
                                                   served_model_name=model_dir.name))
            http_server = make_server(app, host=config.host, port=config.http_port)
            http_task = asyncio.create_task(http_server.serve())
            while not http_server.started:
                if http_task.done():
                    http_task.result()
                await asyncio.sleep(0.05)
            port = http_server.servers[0].sockets[0].getsockname()[1]
            addresses.http = f"http://{config.host}:{port}"
        await gu.set_serving(health, SERVICE)
        log.info("router_ready", grpc=addresses.grpc, http=addresses.http or None)
        if ready is not None:
            ready.set()
        await stop.wait()
        await gu.set_not_serving(health, SERVICE)
        if http_server is not None and http_task is not None:
            http_server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(http_task, config.drain_timeout_s)
        await server.stop(grace=config.drain_timeout_s)
    log.info("router_stopped")
