"""The UCX listener binds the configured host (kvxfer.listen, kvxfer/_listen_host.c).

Real ucxx listeners in this process (the library is loaded by `import kvxfer`, as in every
worker) and, for the refusal, a child process that loads ucxx first."""

from __future__ import annotations

import socket
import subprocess
import sys

import psutil
import pytest
import torch

from kvxfer import KVReceiver, listen
from pdserve.kv_layout import KVLayout

LAYOUT = KVLayout(num_blocks=4, num_layers=2, block_size=16, num_kv_heads=2, head_dim=8,
                  dtype="float32", model_id="m")


def _pool() -> torch.Tensor:
    return torch.zeros(4, 2, 2, 16, 2, 8)


def _listening(port: int) -> list[str]:
    return sorted(c.laddr.ip for c in psutil.Process().net_connections("inet")
                  if c.status == psutil.CONN_LISTEN and c.laddr.port == port)


def _port(rx: KVReceiver) -> int:
    return int(rx.address.rpartition(":")[2])


def _off_host_address() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return str(a.address)
    return None


def test_the_library_is_loaded() -> None:
    assert listen.preload()


@pytest.mark.parametrize(("bind_host", "expected"), [
    (None, "127.0.0.1"),  # the advertised host
    ("127.0.0.1", "127.0.0.1"),
    ("localhost", "127.0.0.1"),  # a name binds what it resolves to
    ("0.0.0.0", "0.0.0.0"),  # every interface only when asked for
])
async def test_the_listener_binds_the_configured_host(bind_host: str | None,
                                                      expected: str) -> None:
    async with KVReceiver(_pool(), LAYOUT, "d:1", bind_host=bind_host) as rx:
        assert _listening(_port(rx)) == [expected]
    assert _listening(_port(rx)) == []


async def test_nothing_off_the_host_reaches_a_loopback_listener() -> None:
    outside = _off_host_address()
    if outside is None:
        pytest.skip("this machine has no address off loopback")
    async with KVReceiver(_pool(), LAYOUT, "d:1") as rx:
        with pytest.raises(ConnectionRefusedError), \
                socket.create_connection((outside, _port(rx)), timeout=5):
            pass
        with socket.create_connection(("127.0.0.1", _port(rx)), timeout=5):
            pass  # the listener itself is there


def test_a_listener_that_cannot_be_bound_refuses_to_start() -> None:
    """ucxx loaded before kvxfer: libucxx is bound to libucp's own ucp_listener_create, so a
    loopback listener would land on every interface; it refuses instead."""
    code = (
        "import asyncio, torch, ucxx\n"
        "import kvxfer\n"
        "from kvxfer import KVReceiver\n"
        "from pdserve.kv_layout import KVLayout\n"
        "LAYOUT = KVLayout(num_blocks=4, num_layers=2, block_size=16, num_kv_heads=2,\n"
        "                  head_dim=8, dtype='float32', model_id='m')\n"
        "async def main():\n"
        "    try:\n"
        "        async with KVReceiver(torch.zeros(4, 2, 2, 16, 2, 8), LAYOUT, 'd:1'):\n"
        "            print('LISTENING')\n"
        "    except OSError as exc:\n"
        "        print('REFUSED', exc)\n"
        "    async with KVReceiver(torch.zeros(4, 2, 2, 16, 2, 8), LAYOUT, 'd:1',\n"
        "                          bind_host='0.0.0.0'):\n"
        "        print('WILDCARD OK')\n"
        "asyncio.run(main())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "REFUSED" in out and "loaded after ucxx" in out, out
    assert "LISTENING" not in out and "WILDCARD OK" in out, out
