"""llama.cpp's RPC backend seen from Python: endpoints, and a handshake that checks a server before llama.cpp
connects to it. llama.cpp's client aborts the whole process when the other end is not an RPC server of its protocol,
and waits forever on one that accepts and stays silent; a Python error is better for both."""
from __future__ import annotations

import socket
import struct
from typing import List, Optional, Sequence

from . import _engine

HELLO = 14            # RPC_CMD_HELLO, the same in every protocol version (a static_assert in ggml-rpc.cpp)
DEVICE_COUNT = 15     # RPC_CMD_DEVICE_COUNT: what llama.cpp's client asks first after its hello
CONN_CAPS_SIZE = 24   # rpc_msg_hello_req: the client's transport capabilities (ggml-rpc/transport.h); none asked


def parse_endpoints(rpc_servers: Optional[Sequence[str]]) -> List[str]:
    """The "host:port" strings of `rpc_servers` (None: none), checked for form."""
    if rpc_servers is None:
        return []
    if isinstance(rpc_servers, str) or not all(isinstance(e, str) for e in rpc_servers):
        raise TypeError(f"rpc_servers must be a list of 'host:port' strings, got {rpc_servers!r}")
    for e in rpc_servers:
        host, _, port = e.rpartition(":")
        if not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"rpc_servers: {e!r} is not 'host:port'")
    return list(rpc_servers)


def check_server(endpoint: str, timeout_s: float = 5.0) -> None:
    """Connect to `endpoint`, exchange llama.cpp's RPC hello and ask its device count, each within `timeout_s`
    seconds; ConnectionError when nothing listens there, it is not an RPC server, it speaks another protocol version,
    or it does not answer (before its hello, or after it: llama.cpp's client would wait for that answer for ever)."""
    if _engine.RPC_PROTO_VERSION is None:
        raise ValueError("this build has no RPC backend (built with -DH2O_LOCAL_RPC=OFF): rpc_servers cannot be used")
    host, _, port = endpoint.rpartition(":")
    hint = f"start one there with `h2o-local rpc-server --host HOST --port {port}`"
    said_hello = False
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(struct.pack("<BQ", HELLO, CONN_CAPS_SIZE) + bytes(CONN_CAPS_SIZE))
            size = struct.unpack("<Q", _receive(sock, 8))[0]
            if size != 4 + CONN_CAPS_SIZE:
                raise _NotRPC(f"its hello answer has {size} bytes")
            major, minor, patch = _receive(sock, size)[:3]
            said_hello = True
            _check_version(endpoint, major, minor, patch)
            sock.sendall(struct.pack("<BQ", DEVICE_COUNT, 0))
            size = struct.unpack("<Q", _receive(sock, 8))[0]
            if size != 4:
                raise _NotRPC(f"its device count answer has {size} bytes")
            if struct.unpack("<I", _receive(sock, 4))[0] < 1:
                raise _NotRPC("it serves no device")
    except socket.timeout:
        if said_hello:
            raise ConnectionError(f"the RPC server at {endpoint} stopped answering after its hello (it did not say "
                                  f"its device count within {timeout_s:g} s); {hint}") from None
        raise ConnectionError(f"the RPC server at {endpoint} did not answer llama.cpp's hello within {timeout_s:g} s "
                              f"(is it an RPC server, and free?); {hint}") from None
    except _NotRPC as e:
        raise ConnectionError(f"{endpoint} is not a llama.cpp RPC server ({e}); {hint}") from None
    except _OtherVersion as e:
        raise ConnectionError(str(e)) from None
    except OSError as e:
        raise ConnectionError(f"cannot reach the RPC server at {endpoint} ({e}); {hint}") from None


def _check_version(endpoint: str, major: int, minor: int, patch: int) -> None:
    want = _engine.RPC_PROTO_VERSION
    if major != want[0] or minor > want[1]:
        raise _OtherVersion(f"the RPC server at {endpoint} speaks protocol {major}.{minor}.{patch}; this build "
                            f"speaks {want[0]}.{want[1]}.{want[2]} (run the same h2o_local version there)")


class _NotRPC(Exception):
    pass


class _OtherVersion(Exception):
    pass


def _receive(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise _NotRPC("it closed the connection during llama.cpp's RPC hello")
        data += part
    return data


def serve(endpoint: str, n_threads: int) -> None:
    """Serve this machine's CPU backend to llama.cpp RPC clients at "host:port" (blocks; returns only when the
    server could not start, its reason printed by ggml)."""
    _engine.rpc_serve(endpoint, n_threads)
