"""The failure model against every published run that reported its interruptions: what the planner forecasts
for each (keel.plan.failure_rates.forecast) beside what the run reported.

For each run: the interruptions its generation's rate gives over the run's wall-clock days, against the count it
published; and the goodput (P50 of the Monte Carlo) with the run's own operational figures, from the
generation's rate and from the run's own count (what the goodput terms give alone), against the effective
training time it published or that its figures imply. Targets: interruptions within 0.5-2× and goodput within 10
points. Results: bench/results/failure_validation.json, rendered into docs/planning.md by bench/tables.py.

    python -m bench.failure_validation [--trials 500]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from keel.plan.failure_rates import RUNS, forecast

RESULTS = Path(__file__).parent / "results" / "failure_validation.json"


def measure(trials: int) -> dict:
    rows = []
    for run in RUNS:
        planned, own = forecast(run, trials=trials), forecast(run, own_rate=True, trials=trials)
        rows.append({"run": run.name, "generation": run.generation, "devices": run.devices, "days": run.days,
                     "source": run.source, "notes": run.notes, "published_interruptions": run.interruptions,
                     "at_least": run.at_least, "published_goodput": run.goodput,
                     "goodput_at_least": run.goodput_at_least, "interruptions": planned["interruptions"],
                     "ratio": planned["interruptions"] / run.interruptions, "goodput": planned["goodput"],
                     "goodput_own_count": own["goodput"], "rate_per_1000_device_days": run.rate * 1000,
                     "generation_rate_per_1000_device_days": planned["rate_per_1000_device_days"]})
    return {"benchmark": "failure_validation", "trials": trials, "runs": rows}


def _goodput_cell(row: dict, key: str) -> str:
    if row["published_goodput"] is None:
        return f"{row[key]:.1%}"
    return f"{row[key]:.1%} ({(row[key] - row['published_goodput']) * 100:+.0f})"


def markdown(results: dict) -> str:
    def mark(row: dict, key: str, at_least: str) -> str:
        return ("over " if row[at_least] else "") + (f"{row[key]:.0%}" if key == "published_goodput" else
                                                     f"{row[key]:,.0f}")

    lines = ["| run | accelerators, days | interruptions published | forecast (×) | goodput published | "
             "forecast (points off) | with its own count | source |", "|---|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        published = "not published" if r["published_goodput"] is None else mark(r, "published_goodput",
                                                                                  "goodput_at_least")
        lines.append(f"| {r['run']} | {r['devices']:,} {r['generation'].title()}, {r['days']:g} | "
                     f"{mark(r, 'published_interruptions', 'at_least')} | {r['interruptions']:,.0f} "
                     f"({r['ratio']:.2f}×) | {published} | {_goodput_cell(r, 'goodput')} | "
                     f"{_goodput_cell(r, 'goodput_own_count')} | {r['source']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=500)
    results = measure(ap.parse_args().trials)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
