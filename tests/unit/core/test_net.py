"""Which links the job's traffic takes, and which of them are down, as the kernel says."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.core.net import carrier_changes, job_interfaces, links_down

ROUTES = """Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\tMTU\tWindow\tIRTT
ib0\t0000A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
eth0\t00000000\t0100A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0
eth0\t0000A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
"""


@pytest.fixture
def kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    routes = tmp_path / "route"
    routes.write_text(ROUTES)
    for nic, state in (("eth0", "up"), ("ib0", "lowerlayerdown"), ("tun0", "unknown")):
        (tmp_path / "net" / nic).mkdir(parents=True)
        (tmp_path / "net" / nic / "operstate").write_text(state + "\n")
        (tmp_path / "net" / nic / "carrier_changes").write_text({"eth0": "4\n", "ib0": "7\n"}.get(nic, "x\n"))
    return tmp_path / "net", routes


def test_the_job_takes_the_interfaces_named_to_its_collectives_else_the_default_route(
        kernel: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    root, routes = kernel
    assert job_interfaces(routes) == ["eth0"]  # the default route's, not every routed one
    routes.write_text(ROUTES.replace("\t00000000\t0100A8C0", "\t0000A8C1\t0100A8C0"))
    assert job_interfaces(routes) == ["eth0", "ib0"]  # no default route: every routed interface
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "^docker0,lo")  # excludes: names none
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0,tun0")
    assert job_interfaces(routes) == ["ib0", "tun0"]
    assert job_interfaces(root / "missing") == ["ib0", "tun0"]


def test_a_link_is_down_when_the_kernel_says_so_or_its_interface_is_gone(
        kernel: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    root, routes = kernel
    assert links_down(root, routes) == []  # eth0 up
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0,ib0,tun0,eth9")
    # ib0 lost its carrier; tun0 reports no link state (unknown: not down); eth9 is gone.
    assert links_down(root, routes) == ["ib0", "eth9"]


def test_the_carrier_changes_are_those_of_the_jobs_links(kernel: tuple[Path, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    root, routes = kernel
    assert carrier_changes(root, routes) == 4  # eth0, the default route's
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0,ib0,tun0,eth9")  # tun0 unreadable, eth9 gone: not counted
    assert carrier_changes(root, routes) == 11
