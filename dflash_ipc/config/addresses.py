"""ZMQ endpoint strings of the config, parsed and checked when the config is read.

A dispatcher address ZMQ cannot bind (`tcp://256.1.1.1:99999`) would otherwise pass the
config, fail the dispatcher at each of its restarts and leave the job waiting; a config
error names it before any process starts. Accepted:

    tcp://HOST:PORT   HOST an IPv4 address, [an IPv6 address], a host or interface name
                      (RFC 1123 labels), or * (every interface); PORT 1..65535
    ipc://PATH        a non-empty socket path of at most 107 bytes (the kernel's sun_path)
"""

from __future__ import annotations

import ipaddress
import re

from dflash_ipc.errors import ConfigError

_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")  # \Z: `$` would pass a label ending in a newline
_MAX_IPC_PATH_BYTES = 107  # sockaddr_un.sun_path is 108 bytes with its terminating NUL


def check_address(address: str, key: str) -> None:
    """ConfigError naming `key` unless `address` is a tcp:// or ipc:// endpoint as above."""
    if address.startswith("ipc://"):
        path = address[len("ipc://"):]
        if not path or len(path.encode()) > _MAX_IPC_PATH_BYTES:
            raise ConfigError(f"{key}: '{address}': an ipc:// path must be non-empty and at most "
                              f"{_MAX_IPC_PATH_BYTES} bytes")
        return
    if not address.startswith("tcp://"):
        raise ConfigError(f"{key}: '{address}' must start with ipc:// or tcp://")
    host, sep, port = address[len("tcp://"):].rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{key}: '{address}': give tcp://HOST:PORT, e.g. tcp://10.0.0.5:29600")
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{key}: '{address}': port {port!r:.20} is not a TCP port (1..65535)")
    problem = _host_problem(host)
    if problem:
        raise ConfigError(f"{key}: '{address}': {problem}")


def _host_problem(host: str) -> str | None:
    if host == "*":
        return None
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
            return None
        except ValueError:
            return f"{host} is not an IPv6 address"
    if re.fullmatch(r"[0-9.]+", host):  # numbers and dots: an IPv4 address or nothing
        try:
            ipaddress.IPv4Address(host)
            return None
        except ValueError:
            return f"{host} is not an IPv4 address (four numbers 0..255)"
    if len(host) > 253 or not all(_LABEL.match(label) for label in host.split(".")):
        return f"{host!r:.80} is not a host name, an IP address or *"
    return None
