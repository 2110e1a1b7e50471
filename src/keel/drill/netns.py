"""A cluster of nodes on one machine, each a network namespace of its own: its own address, its own link, real
TCP between nodes. The nodes hang off a switch, a bridge in a hub namespace, each by a veth pair (`eth0` in the
node, `PREFIX-hN` on the switch), so a node's cable is pulled by setting its switch port down, and a slow port is
a token bucket (`tc … tbf`) on both ends of its cable. A process on node N runs with the host name `node-N` (a UTS
namespace of its own), and every node's name resolves to its address there (the node's own hosts file, which `ip
netns exec` puts in place of /etc/hosts): what finds a peer by host name, as torchft's managers do, finds it.
Nothing is added to the machine's own namespace: the traffic of the cluster never leaves the namespaces it made,
and `close` deletes them (and their hosts files) by name and ends the processes it started by PID, on every exit
path. Needs root and iproute2 (`unavailable` says why not)."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import time
from pathlib import Path

from keel.drill.procs import Launch

IFACE = "eth0"  # each node's one interface: keel's workers are told to use it (GLOO_SOCKET_IFNAME)
NETNS_ETC = Path("/etc/netns")  # `ip netns exec NS` puts the files of NETNS_ETC/NS in place of /etc's
RDZV_PORT = 29400  # a job's rendezvous, inside node 0's namespace, where nothing else listens
_made = itertools.count()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"keel-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as e:
        return f"`ip netns add` failed: {e.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


class Cluster:
    """`nodes` nodes at 10.231.0.1 … 10.231.0.N; a context manager that builds them on entry and removes
    everything on exit. Clusters never see each other (each has its own switch), so they may share addresses."""

    def __init__(self, nodes: int) -> None:
        made = next(_made)
        self.prefix = f"k{os.getpid() % 100000}{made}"  # interface names are 15 bytes at most
        self.nodes = nodes
        self.hub = f"{self.prefix}-hub"
        self.launches: list[Launch] = []
        self.namespaces: list[str] = []

    def namespace(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    def port(self, node: int) -> str:
        """The node's port on the switch: its cable's other end."""
        return f"{self.prefix}-h{node}"

    def address(self, node: int) -> str:
        return f"10.231.0.{node + 1}"

    def hostname(self, node: int) -> str:
        return f"node-{node}"

    def __enter__(self) -> Cluster:
        try:
            self._add(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for node in range(self.nodes):
                ns = self.namespace(node)
                self._add(ns)
                _ip("link", "add", self.port(node), "netns", self.hub, "type", "veth", "peer", "name", IFACE,
                    "netns", ns)
                _ip("-n", self.hub, "link", "set", self.port(node), "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", IFACE)
                _ip("-n", ns, "link", "set", IFACE, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            names = "".join(f"{self.address(node)} {self.hostname(node)}\n" for node in range(self.nodes))
            for ns in map(self.namespace, range(self.nodes)):
                (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
                (NETNS_ETC / ns / "hosts").write_text(f"127.0.0.1 localhost\n{names}")
        except BaseException:
            self.close()
            raise
        return self

    def _add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self.namespaces.append(ns)

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End every process started on a node (by PID, with everything it started), then delete the namespaces
        this cluster made (their interfaces go with them)."""
        for launch in self.launches:
            launch.__exit__(None, None, None)
        for ns in reversed(self.namespaces):
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", ns)
        self.namespaces.clear()

    # ---------------------------------------------------------------- processes on a node
    def on(self, node: int) -> list[str]:
        """The command prefix that runs a program on `node`: in its network namespace, under its host name."""
        return ["ip", "netns", "exec", self.namespace(node), "unshare", "--uts", "sh", "-c",
                f'hostname {self.hostname(node)} && exec "$0" "$@"']

    def keel(self, node: int, args: list[str], cwd: Path, log: Path, env: dict[str, str] | None = None,
             program: list[str] | None = None) -> Launch:
        """`python -m keel ARGS` (or `program ARGS`) on `node`, named `node-N` (KEEL_NODE), its collectives on the
        node's interface; ended with the cluster."""
        launch = Launch(args, cwd, log, env={"KEEL_NODE": self.hostname(node), "GLOO_SOCKET_IFNAME": IFACE,
                                             **(env or {})}, prefix=self.on(node), program=program)
        self.launches.append(launch)
        return launch

    # ---------------------------------------------------------------- faults
    def link_down(self, node: int) -> None:
        """The node's cable pulled: its switch port down, so the node's interface loses its carrier."""
        _ip("-n", self.hub, "link", "set", self.port(node), "down")

    def link_up(self, node: int) -> None:
        _ip("-n", self.hub, "link", "set", self.port(node), "up")

    def flap(self, node: int, down_s: float, times: int = 1, up_s: float = 1.0) -> None:
        """The link down for `down_s` seconds, then up again; `times` times, up for `up_s` in between."""
        for n in range(times):
            time.sleep(up_s if n else 0.0)
            self.link_down(node)
            time.sleep(down_s)
            self.link_up(node)

    def throttle(self, node: int, mbit: float) -> None:
        """The node's link slowed to `mbit` Mbit/s each way: a token bucket on both ends of its cable."""
        rate = f"{mbit}mbit"
        for ns, dev in ((self.hub, self.port(node)), (self.namespace(node), IFACE)):
            subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst",
                            "32kbit", "latency", "400ms"], check=True, capture_output=True, text=True)

    def unthrottle(self, node: int) -> None:
        for ns, dev in ((self.hub, self.port(node)), (self.namespace(node), IFACE)):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=True, capture_output=True,
                           text=True)

    def link_state(self, node: int) -> dict[str, str]:
        """The node's own view of its interface: operstate, carrier_changes and the error and drop counters, as its
        /sys/class/net shows them."""
        out = subprocess.run(["ip", "netns", "exec", self.namespace(node), "sh", "-c",
                              f"cd /sys/class/net/{IFACE} && grep -H . operstate carrier_changes "
                              "statistics/rx_errors statistics/tx_errors statistics/rx_dropped statistics/tx_dropped"],
                             check=True, capture_output=True, text=True).stdout
        return dict(line.split(":", 1) for line in out.split())
