"""The README is the front door: its two commands come first and its config reference is complete."""

from __future__ import annotations

from keel.config import reference
from tests.conftest import REPO


def test_readme_opens_with_the_two_commands() -> None:
    text = (REPO / "README.md").read_text()
    first_block = text.split("```")[1]
    assert "make train" in first_block and "make test" in first_block


def test_readme_config_reference_lists_every_option_with_its_default() -> None:
    text = (REPO / "README.md").read_text()
    for key, tp, default, help_text in reference():
        assert f"| `{key}` | {tp} | `{default}` | {help_text} |" in text, key
