"""The quarantine list: nodes are added, listed and released."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.rundir.quarantine import add_to_quarantine, is_quarantined, node_name, quarantined_nodes, release


def test_quarantine_lists_and_releases_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_NODE", "node-7")
    assert node_name() == "node-7"
    add_to_quarantine(tmp_path, ["node-7"], source="straggler", reason="slow", step=40, ranks=[3])
    add_to_quarantine(tmp_path, ["node-2"], source="keel quarantine", reason="repair")
    assert quarantined_nodes(tmp_path) == {"node-7", "node-2"} and is_quarantined(tmp_path, "node-7")
    assert release(tmp_path, "node-7") == 1
    assert quarantined_nodes(tmp_path) == {"node-2"}
