"""This machine's networking: loopback ports for the servers keel starts on it (rendezvous, lighthouse,
exporter), and the state of the links its job's traffic takes."""

from __future__ import annotations

import os
import socket
from pathlib import Path

SYS_NET = Path("/sys/class/net")
ROUTES = Path("/proc/net/route")
# An interface's operstate, as up (1) or not (0); the states that say nothing of the link (unknown) are left out.
LINK_STATES = {"up": 1.0, "down": 0.0, "lowerlayerdown": 0.0, "dormant": 0.0, "notpresent": 0.0}


def free_port() -> int:
    """A TCP port free on loopback now (the OS's choice; a server started at once almost always gets it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_interfaces(routes: Path = ROUTES) -> list[str]:
    """The interfaces the job's traffic takes: those named to the collectives (GLOO_SOCKET_IFNAME,
    NCCL_SOCKET_IFNAME; an excluding `^name` list names none), else those of the default routes (without one,
    every routed interface)."""
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        named = [n for n in os.environ.get(variable, "").split(",") if n and not n.startswith("^")]
        if named:
            return named
    try:  # IFACE DESTINATION GATEWAY FLAGS REFCNT USE METRIC MASK ..., addresses in hex
        rows = [row for line in routes.read_text().splitlines()[1:] if len(row := line.split()) > 7]
    except OSError:
        return []
    default = {row[0] for row in rows if row[1] == row[7] == "00000000"}
    return sorted(default or {row[0] for row in rows})


def links_down(root: Path = SYS_NET, routes: Path = ROUTES) -> list[str]:
    """The job's interfaces whose link the kernel says is down (no carrier, or the interface gone)."""
    down = []
    for nic in job_interfaces(routes):
        try:
            state = (root / nic / "operstate").read_text().strip()
        except OSError:
            state = "notpresent"
        if LINK_STATES.get(state) == 0.0:
            down.append(nic)
    return down


def carrier_changes(root: Path = SYS_NET, routes: Path = ROUTES) -> int:
    """How many times the job's links lost or found their carrier since their interfaces came up (a flap is two)."""
    total = 0
    for nic in job_interfaces(routes):
        try:
            total += int((root / nic / "carrier_changes").read_text())
        except (OSError, ValueError):
            continue
    return total
