"""The run report of a real run in a real headless Chromium: it loads offline, without a console error,
a page error or a request for anything but itself, and draws its charts. The full-page screenshot is
kept as test-artifacts/report.png (and that of a run of replica groups as test-artifacts/report-replicas.png)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from keel.report.compare import write_comparison
from keel.report.html import write_report
from tests.conftest import REPO, ReplicaRun
from tests.unit.report.test_report import paths, svg_of, train_spiking_run

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
ARTIFACT = REPO / "test-artifacts" / "report.png"

try:
    from playwright.sync_api import sync_playwright
except ImportError:
    sync_playwright = None

pytestmark = [pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no Chromium at {CHROMIUM}"),
              pytest.mark.skipif(sync_playwright is None, reason="the playwright package is not installed")]


@pytest.fixture(scope="module")
def report(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_report(train_spiking_run(small_corpus, tmp_path_factory.mktemp("browser") / "run"))


def open_in_chromium(report: Path, screenshot: Path, inspect: Callable[[Any], dict]) -> dict:
    """Load the report in Chromium, check it loaded offline without an error, keep its full-page screenshot
    and return what `inspect` read from the page."""
    problems: list[str] = []
    requests: list[str] = []
    screenshot.parent.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: problems.append(f"console: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(report.as_uri(), wait_until="load")
            found = inspect(page)
            page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    assert not problems
    assert requests == [report.as_uri()]  # the page needs nothing but itself
    return found


def test_report_renders_in_chromium(report: Path) -> None:
    image_module = pytest.importorskip("PIL.Image", reason="Pillow is not installed")
    found = open_in_chromium(report, ARTIFACT, lambda page: {
        "widths": page.eval_on_selector_all("svg", "svgs => svgs.map(s => s.getBoundingClientRect().width)"),
        "tooltips": page.locator("circle.event title").count()})
    widths, tooltips = found["widths"], found["tooltips"]
    assert len(widths) >= 8 and min(widths) > 100  # every chart laid out at a readable size
    assert tooltips >= 4  # start, checkpoints, the rollback, the finish

    image = image_module.open(ARTIFACT).convert("RGB")
    assert image.width == 1280 and image.height > 1500
    pixels = image.width * image.height
    colours = image.getcolors(maxcolors=pixels)
    assert colours is not None and len(colours) > 200  # text, lines, areas and bars: not a blank page
    assert max(n for n, _ in colours) < 0.9 * pixels
    ink = sum(n for n, (r, g, b) in colours if min(r, g, b) < 225)
    assert ink > 0.02 * pixels
    blue = sum(n for n, (r, g, b) in colours if abs(r - 37) + abs(g - 99) + abs(b - 235) < 60)
    assert blue > 300  # the train loss curve (and the other blue series) were drawn


def test_replica_groups_section_renders_in_chromium(replica_run: ReplicaRun) -> None:
    report = write_report(replica_run.run_dir)
    chart = 'svg[aria-label="live replica groups"]'
    found = open_in_chromium(report, REPO / "test-artifacts" / "report-replicas.png", lambda page: {
        "chart": page.locator(chart).bounding_box(),
        "line": page.locator(f"{chart} path.series").bounding_box(),
        "viewbox": page.locator(chart).get_attribute("viewBox"),
        "bars": page.eval_on_selector_all('svg[aria-label="goodput of each group"] rect',
                                          "rs => rs.map(r => r.getBoundingClientRect().width)"),
        "heals": page.locator("table.heals tbody tr").all_inner_texts()})
    assert found["chart"]["width"] > 300 and found["chart"]["height"] > 100
    # The line as drawn spans what its path spans (scaled as the chart is): its start at the first quorum, its
    # steps from 2 live groups to 1 and back.
    (line,) = paths(svg_of(report.read_text(), "live replica groups"))["live groups"]
    scale = found["chart"]["width"] / float(found["viewbox"].split()[2])
    for axis, i in (("width", 0), ("height", 1)):
        extent = max(p[i] for p in line) - min(p[i] for p in line)
        assert extent > 20 and found["line"][axis] == pytest.approx(extent * scale, abs=3), (axis, found["line"])
    assert len(found["bars"]) == 2 and min(found["bars"]) > 1
    assert any("\theal\t" in row and row.split("\t")[1] == "1" for row in found["heals"])


def test_a_comparison_of_two_runs_renders_in_chromium(report: Path, reference_run: Path, tmp_path: Path) -> None:
    page = write_comparison([report.parent, reference_run], tmp_path / "compare.html")
    found = open_in_chromium(page, REPO / "test-artifacts" / "compare.png", lambda p: {
        "widths": p.eval_on_selector_all("svg", "svgs => svgs.map(s => s.getBoundingClientRect().width)"),
        "lines": p.eval_on_selector_all("path.series", "ps => ps.map(x => x.getBoundingClientRect().width)"),
        "differences": p.locator("table").nth(1).locator("tr").count()})
    assert len(found["widths"]) == 6 and min(found["widths"]) > 300  # six charts, each laid out readably
    assert len(found["lines"]) >= 10 and sorted(found["lines"])[-6] > 100  # both runs drawn across the charts
    assert found["differences"] > 2  # the spiking run's drill and step settings differ from the reference's
