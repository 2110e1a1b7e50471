"""The mixture-of-experts section of the run report: a heat map of each expert layer's loads over the logged
steps, on synthetic runs whose loads are known (a collapsed expert, an overloaded one, a rollback, thousands of
logged steps), and nothing of it for a dense run."""

from __future__ import annotations

import re
from pathlib import Path

from keel.report.html import MAX_COLUMNS, fair_color, write_report
from tests.unit.report.test_report import paths, svg_of, synthetic_run, write_jsonl

WHITE, RED, BUSY = fair_color(1.0), fair_color(0.0), fair_color(2.0)
COLLAPSED = [0.0, 0.25, 0.25, 0.5]  # expert 0 chosen by no token, expert 3 twice its fair share


def expert_run(path: Path, steps: range, redone: range = range(0)) -> Path:
    """Loads of two expert layers (1 and 3) of four experts logged at `steps` (and `redone` again after a
    rollback): layer 1 collapsed as COLLAPSED, layer 3 balanced."""
    path.mkdir(parents=True)
    records = [{"step": s, "train/loss": 3.0, "moe/load/layer_1": COLLAPSED, "moe/load/layer_3": [0.25] * 4,
                "moe/imbalance/layer_1": 2.0, "moe/imbalance/layer_3": 1.0, "moe/entropy/layer_1": 1.2,
                "moe/entropy/layer_3": 1.38, "moe/bias_spread/layer_1": 0.001 * s, "moe/bias_spread/layer_3": 0.0,
                "moe/imbalance_max": 2.0} for s in [*steps, *redone]]
    write_jsonl(path / "metrics.jsonl", records)
    return path


def cells(svg: str) -> list[tuple[float, float, float, str, str]]:
    """(x, y, width, fill, tooltip) of every cell of a heat map."""
    return [(float(x), float(y), float(w), fill, tip) for x, y, w, fill, tip in re.findall(
        r'<rect class="cell" x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" height="[\d.]+" fill="([^"]+)">'
        r'<title>([^<]*)</title>', svg)]


def test_a_dense_run_has_no_expert_section(tmp_path: Path) -> None:
    assert "Mixture of experts" not in write_report(synthetic_run(tmp_path / "dense")).read_text()


def test_each_expert_layer_gets_a_heat_map_whose_rows_are_its_experts(tmp_path: Path) -> None:
    page = write_report(expert_run(tmp_path / "run", range(10, 310, 10))).read_text()
    assert "<h2>Mixture of experts</h2>" in page
    collapsed, balanced = svg_of(page, "expert load, layer 1"), svg_of(page, "expert load, layer 3")
    # Each expert's row holds one rectangle: its load is the same in every interval, so the cells merge.
    rows = cells(collapsed)
    assert [fill for *_, fill, _ in rows] == [RED, WHITE, WHITE, BUSY] and len({RED, WHITE, BUSY}) == 3
    assert len({(x, w) for x, _, w, _, _ in rows}) == 1, "every row spans the same steps"
    assert rows[0][4] == "expert 0 · steps 1–300 · 0.00× the fair load", "the first column is the interval to step 10"
    assert rows[3][4] == "expert 3 · steps 1–300 · 2.00× the fair load"
    assert [y for _, y, *_ in rows] == sorted(y for _, y, *_ in rows), "expert 0 on top"
    assert {fill for *_, fill, _ in cells(balanced)} == {WHITE}
    assert ">expert 0</text>" in collapsed and ">expert 3</text>" in collapsed
    for label in ("Imbalance", "Router entropy", "Balancing biases"):
        assert set(paths(svg_of(page, next(t for t in re.findall(r'aria-label="([^"]+)"', page) if label in t)))) == {
            "layer 1", "layer 3"}, label
    assert "Dropped tokens" not in page, "a dropless run drops nothing"


def test_a_change_of_load_splits_the_row_at_its_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    write_jsonl(run / "metrics.jsonl", [{"step": s, "moe/load/layer_1": [0.5, 0.5] if s <= 40 else [0.0, 1.0]}
                                        for s in range(10, 110, 10)])
    (first, second) = [c for c in cells(svg_of(write_report(run).read_text(), "expert load, layer 1"))
                       if c[4].startswith("expert 0")]
    assert (first[3], second[3]) == (WHITE, RED)
    assert first[4] == "expert 0 · steps 1–40 · 1.00× the fair load"
    assert second[4] == "expert 0 · steps 41–100 · 0.00× the fair load"
    assert first[0] + first[2] == second[0], "the change sits at the step between the two intervals"


def test_steps_abandoned_by_a_rollback_are_not_drawn(tmp_path: Path) -> None:
    run = expert_run(tmp_path / "run", range(1, 21), redone=range(11, 31))
    tips = [tip for *_, tip in cells(svg_of(write_report(run).read_text(), "expert load, layer 1"))]
    assert tips[0] == "expert 0 · steps 1–30 · 0.00× the fair load"
    assert "30 logged intervals" in write_report(run).read_text()


def test_thousands_of_logged_steps_are_averaged_into_columns(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    # 16 experts, each step a different expert starved: no two neighbouring cells of a row merge by chance alone.
    records = [{"step": s, "moe/load/layer_1": [0.0 if e == s % 16 else 1 / 15 for e in range(16)]}
               for s in range(1, 5001)]
    write_jsonl(run / "metrics.jsonl", records)
    page = write_report(run).read_text()
    drawn = cells(svg_of(page, "expert load, layer 1"))
    assert len(drawn) <= 16 * MAX_COLUMNS
    assert "Each column averages 31.2 logged intervals" in page
    assert all(tip.endswith("the fair load") for *_, tip in drawn)


def test_the_colour_is_white_at_the_fair_share_and_deepens_to_an_eighth_and_eight_times_it() -> None:
    assert fair_color(1.0) == "#ffffff"
    assert fair_color(0.0) == fair_color(0.125) == fair_color(0.01) == "#b91c1c"  # none at all, or almost none
    assert fair_color(8.0) == fair_color(64.0) == "#1d4ed8"
    starved = [fair_color(v) for v in (0.125, 0.25, 0.5, 1.0)]
    busy = [fair_color(v) for v in (1.0, 2.0, 4.0, 8.0)]
    assert len(set(starved)) == len(set(busy)) == 4, "each halving or doubling has its own shade"
