"""Prefill worker process: engine (prefill only) + KV sender + gRPC server + lease in Redis."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import structlog
from prometheus_client import CollectorRegistry

from kvxfer.auth import KVAuth
from kvxfer.sender import KVSender
from pdserve.control.directory import WorkerDirectory
from pdserve.control.kv_events import KVEventPublisher, KVEventStreams
from pdserve.control.load import WorkerLoad
from pdserve.control.registry import WorkerRegistry
from pdserve.control.signing import signer_for
from pdserve.control.workers import WorkerInfo, this_cpus, this_host, this_nice
from pdserve.engine.async_engine import AsyncEngine, load_engine
from pdserve.engine.metrics import labelled_registry
from pdserve.engine.model_store import resolve_model
from pdserve.errors import KVTransferError
from pdserve.rpc import auth, transport
from pdserve.runtime import metrics_server
from pdserve.service import Drain, serving
from prefill_svc import servicer
from prefill_svc.config import PrefillConfig
from prefill_svc.metrics import PrefillMetrics
from prefill_svc.worker import PrefillWorker

log = structlog.get_logger(__name__)
SERVICE = "pdserve.v1.PrefillWorker"


async def _warm_peers(directory: WorkerDirectory, sender: KVSender,
                      registered: asyncio.Event) -> None:
    """Open endpoints to every decode worker, those known now and each as it appears, so no
    request pays the handshake. Only once this worker is registered: a decode worker takes
    a signed ping from registered prefill workers only (kvxfer.auth), so a ping sent before
    would be refused, logged there as an unauthenticated write, and leave no endpoint."""
    await registered.wait()
    async for event in directory.events(known=True):
        info = event.worker
        if not info.descriptor_id or not (event.kind == "added" or event.restarted):
            continue
        try:
            await sender.warmup(descriptor_id=info.descriptor_id, timeout_s=5.0)
            log.info("kv_peer_warmed", peer=info.worker_id, descriptor_id=info.descriptor_id)
        except (KVTransferError, OSError) as exc:
            log.warning("kv_peer_warmup_failed", peer=info.worker_id, error=str(exc))


async def run_prefill(config: PrefillConfig, stop: asyncio.Event,
                      ready: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set, then drain (`pdserve.service`): refuse new prefills,
    leave the registry, finish pending prefills and transfers (up to drain_timeout_s), and
    exit."""
    model_dir = resolve_model(config.model)
    engine = await load_engine(model_dir, config.engine)
    metrics = PrefillMetrics(CollectorRegistry())
    secret = config.cluster_secret
    auth.warn_unauthenticated(secret, "prefill_worker")
    kv_auth = None if secret is None else KVAuth(secret.kv_key, sender_id=config.worker_id)
    async with (AsyncEngine(engine) as aengine,
                WorkerRegistry.from_url(config.redis_url, namespace=config.namespace,
                                        signer=signer_for(secret, config.namespace)) as registry,
                # Descriptors are looked up through the registry: a forged one is never dialled.
                KVSender(engine.layout, registry.get_descriptor, auth=kv_auth,
                         shm=config.kv_shm) as sender,
                WorkerDirectory(registry, role="decode",
                                model_id=engine.layout.model_id) as decoders):
        epoch = await registry.next_epoch(config.worker_id)
        worker = PrefillWorker(aengine, sender, worker_id=config.worker_id,
                               max_inflight=config.max_concurrent_prefills,
                               transfer_timeout_s=config.transfer_timeout_s,
                               max_requests=config.max_requests, metrics=metrics,
                               overlap=config.kv_overlap)
        with metrics_server(labelled_registry(metrics.registry,
                                              model_name=config.model_name(model_dir.name)),
                            config.host, config.metrics_port, config.tls) as mport:
            server = transport.new_server(
                auth=auth.cluster_interceptor(secret),
                max_message_bytes=config.grpc_max_message_bytes(aengine.max_model_len),
                max_concurrent_rpcs=config.grpc_max_concurrent_rpcs())
            servicer.add_to_server(worker, server)
            async with serving("prefill_worker", server, SERVICE, config.host, config.port,
                               config.server_credentials()) as service:
                address = service.advertised(config.advertise_host or config.host)
                registered = asyncio.Event()
                warm_task = asyncio.create_task(_warm_peers(decoders, sender, registered))

                def load() -> WorkerLoad:
                    return dataclasses.replace(worker.load(), metrics_port=mport)

                info = WorkerInfo(worker_id=config.worker_id, role="prefill",
                                  grpc_address=address, model_id=engine.layout.model_id,
                                  epoch=epoch, started_at=time.time(), load=load(),
                                  host_id=this_host(), cpus=this_cpus(), nice=this_nice(),
                                  threads=engine.threads,
                                  adapt_threads=config.engine.adapt_threads)

                async def register() -> None:
                    await registry.register(info, config.lease_ttl_s,
                                            heartbeat_s=config.heartbeat_s, load_fn=load,
                                            cpus_fn=this_cpus)
                    registered.set()

                async def deregister() -> None:
                    worker.accepting = False  # a prefill sent before routers notice: refused
                    await registry.deregister()

                # Prefix-cache events, as a decode worker publishes them (same stream,
                # numbering and snapshots): the router prices a remote prefill by what this
                # cache lacks.
                kv_events = KVEventPublisher(
                    KVEventStreams(registry), aengine, lambda: aengine.kv_event_count,
                    worker_id=config.worker_id, epoch=epoch,
                    block_size=engine.config.block_size)
                await kv_events.start()
                try:
                    await service.run(
                        stop, ready,
                        register=register,
                        deregister=deregister,
                        # Pending prefills and their transfers.
                        drain=Drain(config.drain_timeout_s, worker.drained, min_grace_s=5.0),
                        ready_fields=dict(worker_id=config.worker_id, grpc=address,
                                          metrics_port=mport,
                                          threads=engine.config.num_threads),
                        draining_fields=lambda: dict(worker_id=config.worker_id,
                                                     inflight=worker.inflight))
                finally:
                    warm_task.cancel()
                    await kv_events.close()
    log.info("prefill_worker_stopped", worker_id=config.worker_id)
