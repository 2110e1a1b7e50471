"""The run report of a real run in a real headless Chromium: it loads offline, without a console error,
a page error or a request for anything but itself, and draws its charts. The full-page screenshot is
kept as test-artifacts/report.png."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.report.html import write_report
from tests.conftest import REPO
from tests.unit.report.test_report import train_spiking_run

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


def test_report_renders_in_chromium(report: Path) -> None:
    image_module = pytest.importorskip("PIL.Image", reason="Pillow is not installed")
    problems: list[str] = []
    requests: list[str] = []
    ARTIFACT.parent.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: problems.append(f"console: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(report.as_uri(), wait_until="load")
            widths = page.eval_on_selector_all("svg", "svgs => svgs.map(s => s.getBoundingClientRect().width)")
            tooltips = page.locator("circle.event title").count()
            page.screenshot(path=str(ARTIFACT), full_page=True)
        finally:
            browser.close()
    assert not problems
    assert requests == [report.as_uri()]  # the page needs nothing but itself
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
