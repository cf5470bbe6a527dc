"""UCX sockaddr listeners bound to the configured address, not to every interface.

ucxx's Python binding creates a listener from a port alone, so UCX listens on the wildcard
address: a decode worker configured for 127.0.0.1 would still accept KV connections (and
libucx's raw-junk spin, docs/RELIABILITY.md) from off the host. `kvxfer._listen_host` (C,
built with pdserve) defines `ucp_listener_create` and moves a wildcard listener to the host
set here; `preload` puts it ahead of libucp and must run before ucxx is imported (importing
`kvxfer` does). `create_listener` then checks the address the listener really has, so a
process where the library is missing or was loaded too late refuses to listen rather than
listening everywhere.
"""

from __future__ import annotations

import ctypes
import importlib.util
import ipaddress
import socket
import sys
from collections.abc import Callable
from typing import Any

_lib: ctypes.CDLL | None = None
_late = False  # ucxx was imported before the library: it cannot take effect


def preload() -> bool:
    """Load `kvxfer._listen_host` globally, before ucxx loads libucxx. True if it is in."""
    global _lib, _late
    if _lib is not None:
        return True
    if "ucxx" in sys.modules:
        _late = True
    spec = importlib.util.find_spec("kvxfer._listen_host")
    if spec is None or spec.origin is None:
        return False
    try:
        lib = ctypes.CDLL(spec.origin, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return False
    lib.pdserve_ucx_listen_host.argtypes = [ctypes.c_char_p]
    lib.pdserve_ucx_listen_host.restype = ctypes.c_int
    lib.pdserve_ucx_listeners_rebound.argtypes = []
    lib.pdserve_ucx_listeners_rebound.restype = ctypes.c_ulong
    _lib = lib
    return True


def is_wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::")


def numeric_host(host: str) -> str:
    """`host` as the numeric address a socket binds (a name resolves to its first address)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise OSError(f"UCX listen host {host!r} does not resolve: {exc}") from exc
    return str(infos[0][4][0])


def create_listener(callback: Callable[[Any], Any], *, host: str, port: int = 0) -> Any:
    """`ucxx.create_listener(callback, port)` on `host` only ("0.0.0.0" or "::": every
    interface, as asked). Raises OSError where the listener would be wider than `host`."""
    import ucxx

    if is_wildcard(host):
        if _lib is not None:
            _lib.pdserve_ucx_listen_host(b"")
        return ucxx.create_listener(callback, port=port)
    address = numeric_host(host)
    if _lib is None or _late:
        raise OSError(
            f"cannot bind the UCX listener to {address}: kvxfer._listen_host is "
            + ("loaded after ucxx (import kvxfer before ucxx)" if _late else
               "missing (pdserve was built without a C compiler)")
            + "; reinstall pdserve with a C compiler, or listen on every interface with "
            "--host 0.0.0.0 (credentials required)")
    if _lib.pdserve_ucx_listen_host(address.encode()) != 0:
        raise OSError(f"UCX listen host {address!r} is not an IP address")
    before = _lib.pdserve_ucx_listeners_rebound()
    try:
        listener = ucxx.create_listener(callback, port=port)
    finally:
        _lib.pdserve_ucx_listen_host(b"")
    if _lib.pdserve_ucx_listeners_rebound() == before:
        listener.close()
        raise OSError(f"the UCX listener did not bind to {address} (the interposition of "
                      "ucp_listener_create did not take); refusing to listen on every interface")
    return listener
