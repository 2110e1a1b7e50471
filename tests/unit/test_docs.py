"""docs/ holds what the README links to: its generated parts are current, its links resolve, its map of the
code names every package, and its tables name every option and identity field."""

from __future__ import annotations

import re
from pathlib import Path

from bench.tables import stale
from keel.checkpoint.identity import IDENTITY
from keel.config import reference
from tests.conftest import REPO

DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(path: Path) -> str:
    """The page without its code blocks, where brackets are code rather than links."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)


def anchors(path: Path) -> set[str]:
    """The anchors a Markdown renderer gives the page's headings: lower case, punctuation dropped, spaces as -."""
    headings = re.findall(r"^#+ (.+)$", prose(path), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_generated_parts_are_current() -> None:
    assert not stale(), "a generated part of docs/ is stale: `python -m bench.tables` regenerates it"


def test_configuration_reference_lists_every_option_with_its_default() -> None:
    text = (DOCS / "configuration.md").read_text()
    for key, tp, default, help_text in reference():
        assert f"| `{key}` | {tp} | `{default}` | {help_text} |" in text, key


def test_every_relative_link_resolves_to_a_file_and_heading() -> None:
    checked = 0
    for page in PAGES:
        for target in LINK.findall(prose(page)):
            if re.match(r"[a-z]+:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(REPO)} → {target}"
            assert linked.exists(), f"{where}: no such file"
            assert not anchor or anchor in anchors(linked), f"{where}: no such heading"
            checked += 1
    assert checked > len(PAGES)


def test_readme_links_every_page_of_docs() -> None:
    readme = (REPO / "README.md").read_text()
    for page in DOCS.glob("*.md"):
        assert f"](docs/{page.name}" in readme, page.name


def test_architecture_names_every_package_and_top_level_module() -> None:
    text = (DOCS / "architecture.md").read_text()
    src = REPO / "src" / "keel"
    packages = [d.name for d in src.iterdir() if (d / "__init__.py").exists()]
    modules = [f.stem for f in src.glob("*.py") if not f.stem.startswith("__")]
    assert len(packages) > 10 and "errors" in modules
    for name in packages + modules:
        assert f"`keel.{name}`" in text, name


def test_identity_table_names_every_identity_field() -> None:
    text = (DOCS / "resuming.md").read_text()
    table = text[text.index("| identity field |"):].split("\n\n")[0]
    for key in IDENTITY:
        assert f"`{key}`" in table or (key.startswith("model.") and "`model.*`" in table), key
