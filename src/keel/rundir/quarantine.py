"""quarantine.json: the nodes a run must go on without.

The SDC guard, the straggler detector, preflight and `keel quarantine RUN_DIR NODE` add records; each
node's launcher reads the list before the job starts and while it runs, and a listed node leaves the
job (keel.launch) so that the elastic agents of the other nodes re-rendezvous without it. A node is
named by KEEL_NODE when set (several launchers on one machine stand in for nodes), else the host name.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

QUARANTINE = "quarantine.json"


def node_name() -> str:
    return os.environ.get("KEEL_NODE") or socket.gethostname()


def quarantine_records(run_dir: Path) -> list[dict]:
    try:
        records = json.loads((run_dir / QUARANTINE).read_text())
    except (OSError, ValueError):
        return []
    return records if isinstance(records, list) else []


def quarantined_nodes(run_dir: Path) -> set[str]:
    return {h for r in quarantine_records(run_dir) for h in r.get("hosts", [])}


def is_quarantined(run_dir: Path, node: str) -> bool:
    return node in quarantined_nodes(run_dir)


def add_to_quarantine(run_dir: Path, hosts: list[str], source: str, reason: str, step: int | None = None,
                      **detail: Any) -> dict:
    """Append a record (atomically: a launcher reading the file never sees half of it)."""
    record = {"time": round(time.time(), 3), "step": step, "hosts": sorted(set(hosts)), "source": source,
              "reason": reason, **detail}
    _write(run_dir, quarantine_records(run_dir) + [record])
    return record


def release(run_dir: Path, node: str) -> int:
    """Let a repaired node back in; returns how many records named it."""
    records = quarantine_records(run_dir)
    kept = [r for r in records if node not in r.get("hosts", [])]
    _write(run_dir, kept)
    return len(records) - len(kept)


def _write(run_dir: Path, records: list[dict]) -> None:
    tmp = run_dir / f".{QUARANTINE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(records, indent=1) + "\n")
    os.replace(tmp, run_dir / QUARANTINE)
