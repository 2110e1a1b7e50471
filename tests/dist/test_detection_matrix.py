"""The detection matrix of docs/benchmarks.md, re-measured in its replicated column: each cell is a real run with
one flipped bit, compared with a clean run of the same layout (bench/detection_matrix.py measures the whole table;
the sharded layouts' detectors, at-rest seals and replays, are tests/dist/test_guards.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.detection_matrix import BITS, describe, run_matrix
from tests.conftest import REPO, run_keel

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# Flipped runs that train at a time: a 2-process run leaves much of two cores idle (while its launcher
# imports, its workers meet and exit), and no cell's outcome depends on time.
CONCURRENT = 2


def documented_matrix() -> dict[tuple[str, int], dict[str, str]]:
    """(target, bit) → {layout: cell} from the table in docs/benchmarks.md."""
    lines = (REPO / "docs" / "benchmarks.md").read_text().splitlines()
    start = lines.index(next(line for line in lines if line.startswith("| flipped | bit |")))
    layouts = [c.strip() for c in lines[start].strip("|").split("|")][2:]
    table = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        target, bit, *cells = [c.strip() for c in line.strip("|").split("|")]
        table[(target, int(bit.split()[0]))] = dict(zip(layouts, cells, strict=True))
    return table


def runner(args: list[str], cwd: Path) -> int:
    # The preflight's probes sized to the small model, as in tests.conftest.SMALL_RUN.
    return run_keel([*args, "health.preflight_probe_mib=4"], cwd=cwd).returncode


def test_replicas_catch_every_flip_and_recover_exactly(small_corpus: Path, tmp_path: Path) -> None:
    documented = documented_matrix()
    # The top exponent bit in each of the four tensors (the lowest mantissa bit, which the next update may round
    # away on one CPU and not another, is the sharded test's).
    cells = run_matrix(runner, small_corpus, tmp_path, layouts=("replicated",), bits=(30,), concurrent=CONCURRENT)
    assert len(cells) == 4
    for c in cells:
        where = f"{c['target']} bit {c['bit']} ({BITS[c['bit']]})"
        assert c["flipped"], f"{where}: the bit was flipped"
        assert describe(c) == documented[(c["target"], c["bit"])]["replicated"], where
        # A flipped bit in replicated state changes a fingerprint: caught by the next check at the latest,
        # rolled back to a verified state, and the run ends bitwise equal to the clean one.
        assert c["outcome"] == "exact" and c["latency"] <= 5, where
        assert 1 in c["named"], f"{where}: the flipped rank is named (alone, unless the two cannot be told apart)"
