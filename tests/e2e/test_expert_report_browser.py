"""The mixture-of-experts section of a real run's report in a real headless Chromium: the heat maps of expert
load load offline without an error and are drawn readably, starved experts red and overloaded ones blue. The
section's screenshot is kept as test-artifacts/report-experts.png."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from keel.report.html import fair_color, write_report
from tests.conftest import REPO, SMALL_RUN, run_keel
from tests.e2e.test_report_browser import CHROMIUM, open_in_chromium, sync_playwright
from tests.unit.train.test_expert_watch import LAYERS, SHRUNK

ARTIFACT = REPO / "test-artifacts" / "report-experts.png"

pytestmark = [pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no Chromium at {CHROMIUM}"),
              pytest.mark.skipif(sync_playwright is None, reason="the playwright package is not installed")]


def rgb(color: str) -> tuple[int, int, int]:
    return int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16)


def test_the_expert_heat_maps_render_in_chromium(small_corpus: Path, tmp_path: Path) -> None:
    image_module = pytest.importorskip("PIL.Image", reason="Pillow is not installed")
    run_dir = tmp_path / "run"
    # At SMALL_RUN's learning rate tiny_moe's router collapses within a few steps: two experts take every token.
    result = run_keel(["train", "--run-dir", str(run_dir), *SMALL_RUN, *SHRUNK, f"data.dir={small_corpus}",
                       "train.steps=12", "eval.interval=0", "monitor.prometheus_port=0", "health.preflight=off"],
                      cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = write_report(run_dir)
    maps = [f'svg[aria-label="expert load, layer {layer}"]' for layer in LAYERS]

    def inspect(page: Any) -> dict:
        page.locator(maps[0]).screenshot(path=str(ARTIFACT))  # the heat map as the browser drew it
        return {"boxes": [page.locator(m).bounding_box() for m in maps], "cells": page.locator("rect.cell").count(),
                "tips": page.locator(f"{maps[0]} rect.cell title").all_text_contents()}

    found = open_in_chromium(report, tmp_path / "page.png", inspect)
    assert all(box["width"] > 600 and box["height"] > 60 for box in found["boxes"]), found["boxes"]
    assert found["cells"] >= 2 * 8, "a row at least for every expert of both layers"
    assert found["tips"] and all(tip.startswith("expert ") and tip.endswith("the fair load") for tip in found["tips"])

    image = image_module.open(ARTIFACT).convert("RGB")
    colours = image.getcolors(maxcolors=image.width * image.height)
    assert colours is not None

    def near(target: str) -> int:
        r0, g0, b0 = rgb(target)
        return sum(n for n, (r, g, b) in colours if abs(r - r0) + abs(g - g0) + abs(b - b0) < 30)

    area = image.width * image.height
    assert near(fair_color(0.0)) > 0.02 * area, "starved experts are drawn red"
    assert near(fair_color(4.0)) > 0.01 * area, "the two experts that took every token are drawn blue"
