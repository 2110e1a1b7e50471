"""The degree `xp`, added to keel as one file for the length of a test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.config import ParallelConfig
from keel.config.sections import SECTIONS
from keel.parallel.degrees import DEGREES
from tests.package_files import added_module

XP_DEGREE = (Path(__file__).parent / "xp_degree.py").read_text()


@pytest.fixture
def xp(tmp_path: Path) -> Iterator[str]:
    with added_module("keel.parallel.dims", "xp", XP_DEGREE, tmp_path / "added", DEGREES,
                      SECTIONS[ParallelConfig]) as module:
        yield module
