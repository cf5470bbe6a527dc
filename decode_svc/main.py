"""Decode worker process: engine + KV receiver + gRPC server + lease in Redis."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import structlog
from prometheus_client import CollectorRegistry

from decode_svc import servicer
from decode_svc.config import DecodeConfig
from decode_svc.metrics import DecodeMetrics
from decode_svc.worker import DecodeWorker
from kvxfer.auth import KVAuth
from kvxfer.receiver import KVReceiver
from pdserve.control.descriptors import make_descriptor_id
from pdserve.control.directory import WorkerDirectory
from pdserve.control.kv_events import KVEventPublisher, KVEventStreams
from pdserve.control.load import WorkerLoad
from pdserve.control.registry import WorkerRegistry
from pdserve.control.signing import signer_for
from pdserve.control.workers import WorkerInfo, this_cpus, this_host, this_nice
from pdserve.engine.async_engine import AsyncEngine, load_engine
from pdserve.engine.metrics import labelled_registry
from pdserve.engine.model_store import resolve_model
from pdserve.errors import ControlPlaneError
from pdserve.rpc import auth, transport
from pdserve.runtime import metrics_server
from pdserve.service import Drain, serving

log = structlog.get_logger(__name__)
SERVICE = "pdserve.v1.DecodeWorker"


def _kv_auth(config: DecodeConfig, registry: WorkerRegistry,
             prefills: WorkerDirectory) -> KVAuth | None:
    """KV writes are taken from registered prefill workers of this cluster only (kvxfer.auth)."""
    if config.cluster_secret is None:
        return None

    async def is_prefill_worker(sender_id: str) -> bool:
        info = prefills.get(sender_id)
        if info is None:  # registered since the last directory poll: ask Redis
            try:
                info = await registry.get_worker(sender_id)
            except ControlPlaneError:
                return False
        return info is not None and info.role == "prefill"

    return KVAuth(config.cluster_secret.kv_key, authorize_sender=is_prefill_worker)


async def run_decode(config: DecodeConfig, stop: asyncio.Event,
                     ready: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set, then drain (`pdserve.service`): leave the registry
    first (no new requests), keep serving for a heartbeat while routers notice, let
    in-flight streams finish (up to drain_timeout_s), and exit."""
    model_dir = resolve_model(config.model)
    engine = await load_engine(model_dir, config.engine)
    metrics = DecodeMetrics(CollectorRegistry())
    auth.warn_unauthenticated(config.cluster_secret, "decode_worker")
    async with (AsyncEngine(engine) as aengine,
                WorkerRegistry.from_url(
                    config.redis_url, namespace=config.namespace,
                    signer=signer_for(config.cluster_secret, config.namespace)) as registry,
                WorkerDirectory(registry, role="prefill",
                                model_id=engine.layout.model_id) as prefills):
        epoch = await registry.next_epoch(config.worker_id)
        descriptor_id = make_descriptor_id(config.worker_id, epoch)
        async with KVReceiver(engine.kv_pool, engine.layout, descriptor_id,
                              host=config.ucx_host, bind_host=config.host,
                              auth=_kv_auth(config, registry, prefills),
                              shm=config.kv_shm) as receiver:
            worker = DecodeWorker(aengine, receiver, worker_id=config.worker_id,
                                  alloc_lease_s=config.alloc_lease_s,
                                  max_alloc_lease_s=config.max_alloc_lease_s,
                                  max_kv_wait_s=config.max_kv_wait_s,
                                  max_pending_kv_fraction=config.max_pending_kv_fraction,
                                  max_requests=config.max_requests, metrics=metrics)
            with metrics_server(labelled_registry(metrics.registry,
                                              model_name=config.model_name(model_dir.name)),
                                config.host, config.metrics_port, config.tls) as mport:
                server = transport.new_server(
                    auth=auth.cluster_interceptor(config.cluster_secret),
                    max_message_bytes=config.grpc_max_message_bytes(aengine.max_model_len),
                    max_concurrent_rpcs=config.grpc_max_concurrent_rpcs())
                decode_servicer = servicer.add_to_server(worker, server)
                async with serving("decode_worker", server, SERVICE, config.host, config.port,
                                   config.server_credentials()) as service:
                    address = service.advertised(config.advertise_host or config.host)

                    def load() -> WorkerLoad:
                        return dataclasses.replace(worker.load(), metrics_port=mport)

                    info = WorkerInfo(worker_id=config.worker_id, role="decode",
                                      grpc_address=address, model_id=engine.layout.model_id,
                                      epoch=epoch, started_at=time.time(),
                                      ucx_address=receiver.address,
                                      descriptor_id=descriptor_id, load=load(),
                                      host_id=this_host(), cpus=this_cpus(), nice=this_nice(),
                                      threads=engine.threads,
                                      adapt_threads=config.engine.adapt_threads)

                    async def register() -> None:
                        await registry.register(info, config.lease_ttl_s,
                                                heartbeat_s=config.heartbeat_s, load_fn=load,
                                                cpus_fn=this_cpus)
                        await registry.publish_descriptor(descriptor_id, engine.layout,
                                                          receiver.address, config.worker_id,
                                                          epoch)

                    async def drain(budget_s: float) -> None:
                        await worker.drained(budget_s)
                        decode_servicer.end_sessions()  # idle router sessions end now

                    # Prefix-cache events for the routers' index, opening with a snapshot
                    # before we are listed, so a router never routes on a cache it cannot see.
                    kv_events = KVEventPublisher(
                        KVEventStreams(registry), aengine, lambda: aengine.kv_event_count,
                        worker_id=config.worker_id, epoch=epoch,
                        block_size=engine.config.block_size)
                    await kv_events.start()
                    try:
                        await service.run(
                            stop, ready, register=register, deregister=registry.deregister,
                            # Routers drop us within one directory poll (a heartbeat); what
                            # they routed here before, and every running stream, is served.
                            drain=Drain(config.drain_timeout_s, drain,
                                        linger_s=config.heartbeat_s, min_grace_s=5.0),
                            ready_fields=dict(worker_id=config.worker_id, grpc=address,
                                              ucx=receiver.address, metrics_port=mport,
                                              blocks=engine.layout.num_blocks,
                                              threads=engine.config.num_threads),
                            draining_fields=lambda: dict(worker_id=config.worker_id,
                                                         streams=worker.active_streams))
                        await worker.close()
                    finally:
                        await kv_events.close()
    log.info("decode_worker_stopped", worker_id=config.worker_id)
