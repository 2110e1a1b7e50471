"""A run of replica groups seen from outside: `keel status` of the run and of each group, its report's quorum
section, and each group's Prometheus exporter serving the quorum's series. One real run (2 groups, group 1
SIGKILLed at step 5 and healed from group 0) serves every test; its exporters were scraped over HTTP while
it ran."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from keel.report.html import write_report
from keel.rundir.events import read_jsonl
from tests.conftest import ReplicaRun, run_keel
from tests.unit.report.test_report import paths, svg_of

pytestmark = pytest.mark.dist

FT_SERIES = ("keel_ft_participants", "keel_ft_heals", "keel_ft_heal_seconds", "keel_ft_quorum_changes",
             "keel_ft_retries")


def quorum(run_dir: Path, group: int, action: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "groups" / str(group) / "events.jsonl")
            if e["kind"] == "quorum" and e["action"] == action]


def status(run_dir: Path, *args: str) -> str:
    done = run_keel(["status", str(run_dir), *args], cwd=run_dir.parent, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_status_shows_the_run_as_a_whole_and_each_group(replica_run: ReplicaRun) -> None:
    run_dir = replica_run.run_dir
    info = json.loads(status(run_dir, "--json"))
    newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    assert (info["state"], info["step"], info["total_steps"]) == ("finished", 40, 40)
    assert info["last_checkpoint"] == str(newest) and newest.name == "step-000040"
    heal = quorum(run_dir, 1, "heal")
    assert len(heal) == 1, "group 1 healed once, from group 0"
    g0, g1 = info["groups"]
    assert (g0["group"], g0["state"], g0["step"], g0["heals"], g0["last_heal"]) == (0, "finished", 40, 0, None)
    assert (g1["group"], g1["state"], g1["step"], g1["heals"]) == (1, "finished", 40, 1)
    assert g1["last_heal"] == {"time": heal[0]["time"], "step": heal[0]["step"], "heal_s": heal[0]["detail"]["heal_s"]}
    assert g0["participants"] == g1["participants"] == 2  # both live at their last quorum
    assert g0["retries"] == len(quorum(run_dir, 0, "retry")) and g1["retries"] == len(quorum(run_dir, 1, "retry"))
    assert 0 < g1["goodput_ratio"] < g0["goodput_ratio"] <= 1, "the killed group's time down counts against it"
    text = status(run_dir)
    assert f"{run_dir}: finished at step 40/40" in text and f"last checkpoint: {newest}" in text
    assert re.search(r"group 0: finished at step 40 · 2 live at its last quorum · 0 heal\(s\) · \d+ retr", text)
    assert re.search(rf"group 1: finished at step 40 · 2 live at its last quorum · 1 heal\(s\), last "
                     rf"\d\d:\d\d:\d\d at step {heal[0]['step']} in {heal[0]['detail']['heal_s']:.2f} s", text)


def test_status_while_a_group_is_down(replica_run: ReplicaRun) -> None:
    info = replica_run.while_down
    assert info, "group 0's exporter never served 1 live group"
    assert info["state"] == "running" and info["alive"]
    g0, g1 = info["groups"]
    assert g0["state"] == "running" and g0["participants"] == 1
    assert g1["state"] == "running" and g1["heals"] == 0  # its launcher restarts it


def test_a_group_directory_alone_is_an_ordinary_run(replica_run: ReplicaRun) -> None:
    group = replica_run.run_dir / "groups" / "1"
    info = json.loads(status(group, "--json"))
    assert "groups" not in info and info["run_dir"] == str(group)
    assert (info["state"], info["step"]) == ("finished", 40)
    page = write_report(group, group.parent / "report-1.html").read_text()
    assert "<h2>Replica groups</h2>" not in page and "<h2>Training</h2>" in page


def test_report_draws_live_groups_heals_and_goodput(replica_run: ReplicaRun) -> None:
    run_dir = replica_run.run_dir
    page = write_report(run_dir).read_text()
    assert "<h2>Replica groups</h2>" in page and f"run directory {run_dir}" in page
    (line,) = paths(svg_of(page, "live replica groups"))["live groups"]
    levels = sorted({round(y, 1) for y in (y for _, y in line)})
    assert len(levels) == 2, "the chart steps between 2 live groups and 1"
    xs = [x for x, _ in line]
    assert xs == sorted(xs) and any(a[0] == b[0] for a, b in zip(line, line[1:])), "vertical steps"
    heal = quorum(run_dir, 1, "heal")[0]
    table = page.split('<table class="heals">')[1].split("</table>")[0]
    assert re.search(rf'<td class="num">1</td><td>heal</td><td class="num">{heal["step"]}</td><td class="num">'
                     rf'[0-9.]+s</td><td class="num">2</td>', table)
    assert table.count("<tr") - 1 == 1 + sum(len(quorum(run_dir, g, "retry")) for g in (0, 1))
    bars = svg_of(page, "goodput of each group")
    assert bars.count("<rect") == 2 and ">group 0<" in bars and ">group 1<" in bars
    assert "<th>group</th>" in page and page.count("<td>quorum</td>") >= 3  # every group's events


def test_each_groups_exporter_serves_the_quorum_series(replica_run: ReplicaRun) -> None:
    assert set(replica_run.pages) == {0, 1}, "each group serves its own exporter, on its own port"
    for group, page in replica_run.pages.items():
        samples = {s.name: s for family in text_string_to_metric_families(page) for s in family.samples}
        for name in FT_SERIES:
            series = next((s for n, s in samples.items() if n in (name, f"{name}_total")), None)
            assert series is not None, f"group {group} does not serve {name}"
            assert series.labels["run"] == replica_run.run_dir.name
            assert series.labels["replica_group"] == str(group)
        assert samples["keel_ft_heals_total"].value == (1.0 if group == 1 else 0.0)
        assert samples["keel_ft_participants"].value in (1.0, 2.0)
        assert samples["keel_train_loss"].labels["replica_group"] == str(group)
