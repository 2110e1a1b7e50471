"""The README is the front door: its two commands come first."""

from __future__ import annotations

from tests.conftest import REPO


def test_readme_opens_with_the_two_commands() -> None:
    text = (REPO / "README.md").read_text()
    first_block = text.split("```")[1]
    assert "make train" in first_block and "make test" in first_block
