"""llama.cpp RPC workers, seen from localspec: endpoint parsing and a pre-flight check. Pure Python.

llama.cpp aborts the whole process (GGML_ABORT, a gdb backtrace, exit 134) when it cannot connect to a worker
or the worker speaks another protocol version. So before anything hands an endpoint to llama.cpp, `preflight`
connects to each worker itself, with a timeout, and speaks the protocol's HELLO.

The wire format (ggml/src/ggml-rpc/ggml-rpc.cpp in the llama.cpp vendored by llama-cpp-python 0.3.36):
  request : | cmd (1 byte) | request size (uint64 LE) | request bytes |
  response: | response size (uint64 LE) | response bytes |
HELLO is command 14 (fixed for all versions). Its request is conn_caps[24] (all zero: plain TCP, no RDMA); its
response is major, minor, patch, padding (1 byte each) + conn_caps[24]. The client accepts a server whose major
equals its own and whose minor is not newer (negotiate_hello). A server from before protocol 7 reads a HELLO with
a request size other than 0 as a mismatch and closes the connection.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct
from typing import Iterable, Sequence

from localspec.errors import LocalspecError, UsageError

# ggml/include/ggml-rpc.h of the llama.cpp that llama-cpp-python 0.3.36 vendors
RPC_PROTO_MAJOR = 7
RPC_PROTO_MINOR = 0
RPC_PROTO_PATCH = 0
RPC_CMD_HELLO = 14
RPC_CONN_CAPS_SIZE = 24
HELLO_RSP_SIZE = 4 + RPC_CONN_CAPS_SIZE
MAX_SERVERS = 16  # GGML_RPC_MAX_SERVERS
DEFAULT_PORT = 50052
SECURITY_WARNING = (
    "warning: the RPC protocol has no authentication and no encryption: anyone who can reach {endpoint} can use "
    "this machine's memory and compute through it, and model data and activations cross the network in the clear. "
    "Use it only on a trusted network."
)


class RPCError(LocalspecError):
    """A worker that cannot be used (unreachable, not an RPC server, another protocol version)."""


def parse_servers(spec: str | Sequence[str] | None) -> list[str]:
    """`HOST:PORT[,HOST:PORT...]` -> ["HOST:PORT", ...]; [] for None/empty. Bad input is a UsageError."""
    if spec is None:
        return []
    items = spec.split(",") if isinstance(spec, str) else [p for s in spec for p in str(s).split(",")]
    items = [s.strip() for s in items]
    if all(not s for s in items):
        return []
    out: list[str] = []
    for item in items:
        host, port = _split_endpoint(item)
        ep = f"{host}:{port}"
        if ep in out:
            raise UsageError(f"--rpc lists {ep} twice")
        out.append(ep)
    if len(out) > MAX_SERVERS:
        raise UsageError(f"--rpc: llama.cpp takes at most {MAX_SERVERS} workers, got {len(out)}")
    return out


def _split_endpoint(item: str) -> tuple[str, int]:
    if not item:
        raise UsageError("--rpc: empty entry (expected HOST:PORT[,HOST:PORT...])")
    if item.count(":") != 1:
        why = "IPv6 addresses are not supported by llama.cpp's RPC client" if item.count(":") > 1 else "no port"
        raise UsageError(f"--rpc: bad worker address {item!r} ({why}; expected HOST:PORT, e.g. 192.168.1.7:{DEFAULT_PORT})")
    host, port_s = item.split(":")
    host = host.strip()
    if not host or any(c.isspace() for c in host):
        raise UsageError(f"--rpc: bad host in {item!r} (expected HOST:PORT)")
    try:
        port = int(port_s)
    except ValueError:
        raise UsageError(f"--rpc: bad port in {item!r} (expected a number 1-65535)") from None
    if not 1 <= port <= 65535:
        raise UsageError(f"--rpc: port out of range in {item!r} (1-65535)")
    return host, port


def parse_tensor_split(spec: str | Sequence[float] | None) -> list[float] | None:
    """`3,1` (or `3/1`) -> [3.0, 1.0]: the share of the target's layers for each device in order (the workers in
    --rpc order, then local GPUs). None when not given."""
    if spec is None:
        return None
    if isinstance(spec, str):
        if not spec.strip():
            return None
        parts = spec.replace("/", ",").split(",")
    else:
        parts = list(spec)
    vals: list[float] = []
    for p in parts:
        try:
            v = float(p)
        except (TypeError, ValueError):
            raise UsageError(f"--tensor-split: {p!r} is not a number (expected e.g. 3,1)") from None
        if not v >= 0 or v == float("inf"):
            raise UsageError(f"--tensor-split: proportions must be finite and >= 0, got {p!r}")
        vals.append(v)
    if not vals or sum(vals) <= 0:
        raise UsageError("--tensor-split: at least one proportion must be > 0")
    if len(vals) > MAX_SERVERS:
        raise UsageError(f"--tensor-split: at most {MAX_SERVERS} values")
    return vals


def host_port(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.rsplit(":", 1)
    return host, int(port)


def hello(endpoint: str, timeout: float = 5.0) -> tuple[int, int, int]:
    """Connect, send HELLO, return the worker's (major, minor, patch). Raises RPCError with one-line reasons."""
    host, port = host_port(endpoint)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except socket.gaierror as exc:
        raise RPCError(f"RPC worker {endpoint}: cannot resolve {host!r} ({exc.strerror or exc})") from None
    except (TimeoutError, socket.timeout):
        raise RPCError(f"RPC worker {endpoint} is unreachable (no answer to connect within {timeout:g} s)") from None
    except OSError as exc:
        if exc.errno == errno.ECONNREFUSED:
            raise RPCError(f"RPC worker {endpoint} refused the connection (is `localspec worker` running there, "
                           "on that port and address?)") from None
        raise RPCError(f"RPC worker {endpoint} is unreachable ({exc.strerror or exc})") from None
    try:
        with sock:
            sock.settimeout(timeout)
            sock.sendall(struct.pack("<BQ", RPC_CMD_HELLO, RPC_CONN_CAPS_SIZE) + bytes(RPC_CONN_CAPS_SIZE))
            size = struct.unpack("<Q", _recv_exact(sock, 8, endpoint))[0]
            if size != HELLO_RSP_SIZE:
                raise RPCError(f"{endpoint} is not a compatible llama.cpp RPC worker (HELLO answer of {size} bytes, "
                               f"expected {HELLO_RSP_SIZE}: another protocol version, or another kind of server)")
            major, minor, patch = struct.unpack("<BBB", _recv_exact(sock, HELLO_RSP_SIZE, endpoint)[:3])
    except (TimeoutError, socket.timeout):
        raise RPCError(f"RPC worker {endpoint} accepted the connection but did not answer the RPC HELLO within "
                       f"{timeout:g} s (not an RPC worker, or busy serving another client)") from None
    except OSError as exc:
        raise RPCError(f"RPC worker {endpoint}: connection failed during the HELLO ({exc.strerror or exc})") from None
    return major, minor, patch


def _recv_exact(sock: socket.socket, n: int, endpoint: str) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise RPCError(f"{endpoint} closed the connection during the RPC HELLO (not a llama.cpp RPC worker, or "
                           f"one older than protocol v{RPC_PROTO_MAJOR}; this localspec speaks "
                           f"{RPC_PROTO_MAJOR}.{RPC_PROTO_MINOR}.{RPC_PROTO_PATCH})")
        buf += chunk
    return buf


def check_version(endpoint: str, version: tuple[int, int, int]) -> None:
    major, minor, patch = version
    if major != RPC_PROTO_MAJOR or minor > RPC_PROTO_MINOR:
        raise RPCError(f"RPC worker {endpoint} speaks protocol {major}.{minor}.{patch} but this localspec's llama.cpp "
                       f"speaks {RPC_PROTO_MAJOR}.{RPC_PROTO_MINOR}.{RPC_PROTO_PATCH}; install the same localspec and "
                       "llama-cpp-python version on both machines")


def preflight(servers: Iterable[str], timeout: float = 5.0) -> dict[str, tuple[int, int, int]]:
    """HELLO every worker and check its protocol version; {endpoint: version}. Raises RPCError (exit 1)."""
    out = {}
    for ep in servers:
        v = hello(ep, timeout)
        check_version(ep, v)
        out[ep] = v
    return out


def check_settings(servers: str | None, tensor_split: str | None = None) -> list[str]:
    """Parse the `rpc` and `tensor_split` settings and check every worker: before a pair is resolved or
    downloaded, so a worker that is down costs nothing. Returns the endpoints."""
    workers = parse_servers(servers)
    parse_tensor_split(tensor_split)
    preflight(workers)
    return workers


def refusing(servers: Iterable[str], timeout: float = 0.5) -> list[str]:
    """The workers that no longer accept connections (dead process, or host down). A live worker busy with our
    own connection still accepts (the kernel queues it), so it is not listed."""
    dead = []
    for ep in servers:
        try:
            socket.create_connection(host_port(ep), timeout=timeout).close()
        except OSError:
            dead.append(ep)
    return dead


# ------------------------------------------------------------------ the worker's listening address
def listen_address(host: str, port: int) -> str:
    """Validate what `localspec worker` may bind: an IPv4 address (llama.cpp's server uses inet_addr)."""
    if host == "localhost":
        host = "127.0.0.1"
    try:
        addr = ipaddress.IPv4Address(host)
    except ValueError:
        raise UsageError(f"--host must be an IPv4 address such as 127.0.0.1 or 0.0.0.0, got {host!r}") from None
    if not 1 <= port <= 65535:
        raise UsageError(f"--port must be 1-65535, got {port}")
    return str(addr)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.IPv4Address(host).is_loopback
    except ValueError:
        return False
