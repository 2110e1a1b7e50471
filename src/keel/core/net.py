"""Loopback ports for the servers keel starts on one machine (rendezvous, lighthouse, exporter)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on loopback now (the OS's choice; a server started at once almost always gets it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
