"""The failure-drill section of `keel report`: the scorecard `keel drill` left in drill.json, one row per
scenario with its promise, detection, recovery, what was lost, a plain restart's cost and the verdict."""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

from keel.drill.scorecard import detected, fault_lines, lost, recovered, restart, verdict

DRILL_FILE = "drill.json"


def load_drill(run_dir: Path) -> dict | None:
    try:
        record = json.loads((run_dir / DRILL_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("results"), list) else None


def drill_section(record: dict) -> str:
    results = record["results"]
    rows = []
    for r in results:
        kept = r.get("promise_kept")
        css = "" if kept else "warn" if kept is None else "bad"
        story = " → ".join(r.get("events", [])[:12])
        rows.append(f'<tr class="{css}"><td>{escape(r["scenario"])}</td><td>{escape(r["promise"])}</td>'
                    f'<td>{escape(detected(r))}</td><td>{escape(recovered(r))}</td><td>{escape(lost(r))}</td>'
                    f'<td>{escape(restart(r))}</td><td><b>{escape(verdict(r))}</b>'
                    f'{f"<br><small>{escape(story)}</small>" if story else ""}</td></tr>')
    faults = "".join(f'<p class="note">{escape(line)}</p>' if not line.startswith("  ") else
                     f'<p class="note" style="margin:0 0 0 16px;font-family:monospace">{escape(line.strip())}</p>'
                     for r in results for line in fault_lines(r))
    judged = [r for r in results if r.get("promise_kept") is not None]
    kept = sum(1 for r in judged if r["promise_kept"])
    about = [f"{kept} of {len(judged)} promises kept", f"{record.get('nproc', '?')} processes",
             f"{record.get('steps', '?')} steps, a checkpoint every {record.get('interval', '?')}"]
    if record.get("suite"):
        about.append(f"suite {record['suite']}" + (" (chaos)" if record.get("chaos") else ""))
    baseline = record.get("baseline") or {}
    note = (f'<p class="note">plain restart: {baseline["restart_s"]:.1f} s from a launch to its first step after '
            f'loading the step-{baseline["from_step"]} checkpoint, then {baseline["step_s"]:.2f} s per step made '
            f'again.</p>') if baseline.get("restart_s") is not None else ""
    return (f'<h2>Failure drills</h2><p class="sub">{escape(" · ".join(about))}</p><table><thead><tr>'
            f'<th>scenario</th><th>promise</th><th>detected in</th><th>recovered in</th><th>lost</th>'
            f'<th>plain restart</th><th>verdict</th></tr></thead><tbody>{"".join(rows)}</tbody></table>{faults}{note}')
