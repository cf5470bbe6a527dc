"""Shared helpers for the network-fault tests (issue 11): a network namespace reached over a
veth pair, tc shaping on both ends, processes started with their logs in the test's folder.

Layout (addresses are a random 10.213.x.y/30 made here; nothing else is touched):

    root namespace: redis-server, router (127.0.0.1), the other workers (on H)
         H = 10.213.x.(4k+1) on veth "pdXXXXXXa"
              |  veth pair (tc shaping here, both ends)
         W = 10.213.x.(4k+2) on veth "pdXXXXXXb"
    namespace "pdnsXXXXXX": the worker under test (gRPC and UCX on W), Redis via H

Faults are `tc` htb classes with u32 filters on ports, and `ip link set down`: this kernel has
no `sch_netem`, no prio qdisc, no tc actions (`action drop`) and no iptables/nft, so a slow link
queues (delays) packets, a short queue drops them and a zero-length queue drops them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdserve.cluster import free_port, wait_port
from pdserve.deathsig import guarded

CLI = [sys.executable, "-m", "pdserve.cli"]


def ip_cmd(*args: str, ns: str | None = None, check: bool = True) -> \
        subprocess.CompletedProcess[str]:
    argv = ["ip", "netns", "exec", ns, *args] if ns else list(args)
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=30)


@dataclass
class Veth:
    ns: str
    host_if: str  # root-namespace end
    ns_if: str
    host_ip: str  # H
    ns_ip: str  # W

    def shape(self, rate: str, limit_packets: int, exempt_ports: tuple[int, ...] = (), *,
              only_ports: tuple[int, ...] = ()) -> None:
        """Both ends' egress limited to `rate` with a `limit_packets` queue (excess packets are
        dropped: a slow, lossy link; 0 drops every packet). Traffic to or from `exempt_ports`
        (and ARP) passes at full speed: a fault on the other paths only. With `only_ports`,
        the reverse: only traffic to or from those ports is shaped."""
        slow, fast = "1:20", "1:10"
        default, matched = ("10", slow) if only_ports else ("20", fast)
        for dev, ns in ((self.host_if, None), (self.ns_if, self.ns)):
            ip_cmd("tc", "qdisc", "del", "dev", dev, "root", ns=ns, check=False)
            ip_cmd("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default",
                   default, ns=ns)
            ip_cmd("tc", "class", "add", "dev", dev, "parent", "1:", "classid", fast, "htb",
                   "rate", "1gbit", ns=ns)
            ip_cmd("tc", "class", "add", "dev", dev, "parent", "1:", "classid", slow, "htb",
                   "rate", rate, "ceil", rate, ns=ns)
            ip_cmd("tc", "qdisc", "add", "dev", dev, "parent", slow, "handle", "20:", "pfifo",
                   "limit", str(limit_packets), ns=ns)
            ip_cmd("tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "arp",
                   "prio", "1", "u32", "match", "u32", "0", "0", "flowid", fast, ns=ns)
            for port in only_ports or exempt_ports:
                for field in ("sport", "dport"):
                    ip_cmd("tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip",
                           "prio", "2", "u32", "match", "ip", field, str(port), "0xffff",
                           "flowid", matched, ns=ns)

    def dropped(self) -> int:
        """Packets the shaped class dropped so far, both ends."""
        total = 0
        for dev, ns in ((self.host_if, None), (self.ns_if, self.ns)):
            out = ip_cmd("tc", "-s", "qdisc", "show", "dev", dev, ns=ns, check=False).stdout
            after = out.split("qdisc pfifo 20:", 1)
            if len(after) == 2 and "dropped " in after[1]:
                total += int(after[1].split("dropped ", 1)[1].split(",", 1)[0])
        return total

    def clear(self) -> None:
        for dev, ns in ((self.host_if, None), (self.ns_if, self.ns)):
            ip_cmd("tc", "qdisc", "del", "dev", dev, "root", ns=ns, check=False)

    def link(self, up: bool) -> None:
        ip_cmd("ip", "link", "set", self.host_if, "up" if up else "down")


@contextlib.contextmanager
def make_veth() -> Iterator[Veth]:
    """A namespace and a veth pair into it, removed afterwards; skips the test without root,
    iproute2, `ip netns` or tc htb."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("iproute2 (ip, tc) is not installed")
    tag = uuid.uuid4().hex[:6]
    ns, host_if, ns_if = f"pdns{tag}", f"pd{tag}a", f"pd{tag}b"
    base = random.randrange(0, 64) * 4
    third = random.randrange(0, 256)
    v = Veth(ns, host_if, ns_if, f"10.213.{third}.{base + 1}", f"10.213.{third}.{base + 2}")
    if ip_cmd("ip", "netns", "add", ns, check=False).returncode != 0:
        pytest.skip("`ip netns add` failed (no CAP_SYS_ADMIN?)")
    try:
        ip_cmd("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        ip_cmd("ip", "link", "set", ns_if, "netns", ns)
        ip_cmd("ip", "addr", "add", f"{v.host_ip}/30", "dev", host_if)
        ip_cmd("ip", "link", "set", host_if, "up")
        ip_cmd("ip", "addr", "add", f"{v.ns_ip}/30", "dev", ns_if, ns=ns)
        ip_cmd("ip", "link", "set", ns_if, "up", ns=ns)
        ip_cmd("ip", "link", "set", "lo", "up", ns=ns)
        tc = ip_cmd("tc", "qdisc", "add", "dev", host_if, "root", "handle", "1:", "htb",
                    check=False)
        if tc.returncode != 0:
            pytest.skip(f"tc htb is not available: {tc.stderr.strip()}")
        ip_cmd("tc", "qdisc", "del", "dev", host_if, "root")
        yield v
    finally:
        ip_cmd("ip", "link", "del", host_if, check=False)  # takes the peer end with it
        ip_cmd("ip", "netns", "del", ns, check=False)


_WARNING = re.compile(r'\[(warning|error|critical)|"level": ?"(warning|error|critical)"', re.I)


class Procs:
    """Processes of one test, each logging to `<log_dir>/<name>.log`, stopped by close()."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> \
            subprocess.Popen[bytes]:
        with open(self.log_dir / f"{name}.log", "wb") as log:  # the child keeps its own copy
            p = subprocess.Popen(guarded(argv), stdout=log, stderr=subprocess.STDOUT,
                                 env={**os.environ, **(env or {})})
        self.procs[name] = p
        return p

    def check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                pytest.fail(f"{name} exited: {(self.log_dir / (name + '.log')).read_text()}")

    def warnings(self, limit: int = 40) -> str:
        """The last `limit` warning and error lines of every log, for a failure's message."""
        out = []
        for path in sorted(self.log_dir.glob("*.log")):
            lines = [ln for ln in path.read_text(errors="replace").splitlines()
                     if _WARNING.search(ln) or "Traceback" in ln]
            out += [f"{path.stem}: {ln}" for ln in lines[-limit:]]
        return "\n".join(out)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


class NetCluster:
    """Redis (password-protected, bound to 127.0.0.1 and H), a router on 127.0.0.1 and
    workers, each either in the root namespace (gRPC on H) or behind the veth (gRPC on W).
    Workers run UCX over TCP on their veth end only (UCX_TLS=tcp, UCX_NET_DEVICES) with the
    same-host KV paths off (--no-kv-shm), so KV bytes cross the veth like they would cross a
    network (not shared memory)."""

    PASSWORD = "netpw"

    def __init__(self, veth: Veth, log_dir: Path, model_dir: Path) -> None:
        redis_exe = shutil.which("redis-server")
        if redis_exe is None:
            pytest.skip("redis-server is not installed")
        self.veth, self.model_dir = veth, model_dir
        self.procs = Procs(log_dir)
        self.namespace = f"net{uuid.uuid4().hex[:8]}"
        self.redis_port, router_port, http_port = free_port(), free_port(), free_port()
        self.router = f"127.0.0.1:{router_port}"
        self.http = f"http://127.0.0.1:{http_port}"
        self.ports: dict[str, int] = {}  # worker id -> gRPC port
        self.addresses: dict[str, str] = {}  # worker id -> gRPC address
        self._redis_exe = redis_exe
        self._router_port, self._http_port = router_port, http_port

    def start(self, workers: list[tuple[str, str, bool]],
              router_args: tuple[str, ...] = ()) -> None:
        """`workers`: (role, worker id, behind the veth); waits for nothing."""
        redis = self.procs.spawn("redis", [
            self._redis_exe, "--port", str(self.redis_port), "--bind",
            f"127.0.0.1 {self.veth.host_ip}", "--save", "", "--appendonly", "no",
            "--requirepass", self.PASSWORD])  # not loopback-only
        wait_port(self.redis_port, redis, 10, "redis-server")
        for role, worker_id, in_ns in workers:
            self.add_worker(role, worker_id, in_ns)
        self.procs.spawn("router", [
            *CLI, "router", "--namespace", self.namespace, "--model", str(self.model_dir),
            "--redis-url", f"redis://:{self.PASSWORD}@127.0.0.1:{self.redis_port}/0",
            "--host", "127.0.0.1", "--port", str(self._router_port),
            "--http-port", str(self._http_port), *router_args])

    def add_worker(self, role: str, worker_id: str, in_ns: bool) -> None:
        v = self.veth
        host, redis_host, dev = (v.ns_ip, v.host_ip, v.ns_if) if in_ns else \
            (v.host_ip, "127.0.0.1", v.host_if)
        port = self.ports[worker_id] = free_port()
        self.addresses[worker_id] = f"{host}:{port}"
        argv = [*CLI, f"{role}-worker", "--namespace", self.namespace, "--model",
                str(self.model_dir), "--kv-cache-mb", "64", "--threads", "1",
                "--metrics-port", "-1", "--worker-id", worker_id,
                "--redis-url", f"redis://:{self.PASSWORD}@{redis_host}:{self.redis_port}/0",
                "--host", host, "--port", str(port),
                "--insecure",  # H is not loopback and these workers have no cluster secret
                # One machine, so without this the KV would take the same-host path (one
                # process_vm_readv copy, or the staging ring) and never cross the veth.
                "--no-kv-shm"]
        self.procs.spawn(worker_id, ["ip", "netns", "exec", v.ns, *argv] if in_ns else argv,
                         env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev})

    async def listed(self) -> set[str]:
        return {w["worker_id"] for w in await router_workers(self.http)}

    async def wait_ready(self, timeout_s: float = 400) -> None:
        async def all_listed() -> bool:
            self.procs.check_alive()
            return await self.listed() == set(self.ports)
        await until(all_listed, timeout_s, "cluster ready")

    def close(self) -> None:
        self.procs.close()


async def router_workers(http: str) -> list[dict]:
    """The workers the router lists (empty when it does not answer)."""
    try:
        async with httpx.AsyncClient(timeout=2) as client:
            r = await client.get(f"{http}/v1/pdserve/workers")
        return r.json().get("workers", []) if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError):
        return []


async def until(pred: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> float:
    """Seconds until `await pred()` held; fails the test after `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if await pred():
            return time.monotonic() - start
        await asyncio.sleep(0.1)
    pytest.fail(f"{what}: not within {timeout_s}s")
