"""The drill's scorecard: one line per scenario, and whether every promise was kept."""

from __future__ import annotations

import textwrap
from typing import Any

HEADER = ("scenario", "promise", "detected in", "recovered in", "lost", "plain restart", "verdict")
PROMISE_WIDTH = 48


def detected(r: dict[str, Any]) -> str:
    if r.get("not_run"):
        return ""
    if r.get("detected_by") is None:
        return "-"
    steps = f"+{r['detect_steps']} steps" if r.get("detect_steps") is not None else ""
    seconds = f"{r['detect_s']:.1f} s" if r.get("detect_s") is not None else ""
    return ", ".join(filter(None, [steps, seconds]))


def recovered(r: dict[str, Any]) -> str:
    return "" if r.get("not_run") else "-" if r.get("recover_s") is None else f"{r['recover_s']:.1f} s"


def lost(r: dict[str, Any]) -> str:
    if r.get("not_run") or r.get("steps_lost") is None:
        return ""
    parts = []
    if r.get("steps_recomputed"):
        parts.append(f"{r['steps_recomputed']} recomputed")
    if r.get("updates_skipped"):
        parts.append(f"{r['updates_skipped']} skipped")
    if r.get("steps_retried"):  # replica groups: a step no group committed, made again from the same batch
        parts.append(f"{r['steps_retried']} retried")
    return ", ".join(parts) or "0 steps"


def restart(r: dict[str, Any]) -> str:
    """What a plain restart from the last checkpoint would have cost at the same fault."""
    if r.get("restart_s") is None:
        return ""
    return f"{r['restart_steps_lost']} steps, {r['restart_s']:.1f} s"


def verdict(r: dict[str, Any]) -> str:
    if r.get("not_run"):
        return "not run: " + r["not_run"]
    return "kept" if r["promise_kept"] else "BROKEN: " + "; ".join(r.get("broken", []))


def format_scorecard(results: list[dict[str, Any]], baseline: dict[str, Any] | None = None) -> str:
    """A terminal table; the promise wraps within its column, the verdict takes the rest of the line."""
    rows = [(r["scenario"], textwrap.wrap(r["promise"], PROMISE_WIDTH) or [""], detected(r), recovered(r),
             lost(r), restart(r), verdict(r)) for r in results]
    widths = [max(len(HEADER[i]), *(len(row[i]) for row in rows)) if i != 1 else PROMISE_WIDTH
              for i in range(len(HEADER) - 1)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(HEADER, widths, strict=False)) + "  " + HEADER[-1]]
    lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len(HEADER[-1]))
    for name, promise, *cells, said in rows:
        first = [name, promise[0], *cells]
        lines.append("  ".join(c.ljust(w) for c, w in zip(first, widths, strict=True)) + "  " + said)
        for more in promise[1:]:
            lines.append("  ".join(c.ljust(w) for c, w in zip(["", more, "", "", "", ""], widths,
                                                              strict=True)).rstrip())
    for r in results:
        lines.extend(fault_lines(r))
    kept = sum(1 for r in results if r.get("promise_kept"))
    judged = sum(1 for r in results if r.get("promise_kept") is not None)
    lines.append(f"{kept} of {judged} promises kept" + (f", {len(results) - judged} not run" if judged < len(results)
                                                         else ""))
    if baseline and baseline.get("restart_s") is not None:
        lines.append(f"plain restart: {baseline['restart_s']:.1f} s from a launch to its first step after loading "
                     f"the step-{baseline['from_step']} checkpoint, "
                     f"then {baseline['step_s']:.2f} s per step made again")
    return "\n".join(lines)


def fault_lines(r: dict[str, Any]) -> list[str]:
    """One line per fault of a run that had many (chaos): where it landed, what saw it, how fast; for replica
    groups, how long the survivors' longest step took and how often the lost group healed."""
    if r.get("groups", 1) > 1 and r.get("survivor_max_step_s") is not None:
        return [f"{r['scenario']}: {r['groups']} replica groups; the survivors' longest step "
                f"{r['survivor_max_step_s']:.2f} s (median {r['survivor_median_step_s']:.2f} s), the lost group "
                f"healed {r['heals']} time(s), final parameters {r['param_max_abs_diff']:.2g} from the reference"]
    if not r.get("faults"):
        return []
    lines = [f"{r['scenario']}: {len(r['faults'])} faults"]
    for f in r["faults"]:
        seen = (f"{f['detected_by']} at step {f['detected_at_step']} in {f['detect_s']:.2f} s" if f["detected_by"]
                else "fired, undetected" if f["fired"] else "never fired")
        back = f", recovered in {f['recover_s']:.2f} s" if f.get("recover_s") is not None else ""
        lines.append(f"  {f['kind'] + '@' + str(f['step']):24} {seen}{back}")
    return lines


def all_kept(results: list[dict[str, Any]]) -> bool:
    """True when no scenario that ran broke its promise (scenarios not run break none)."""
    return all(r.get("promise_kept") is not False for r in results)
