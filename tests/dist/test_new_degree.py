"""A degree added as one file (tests/unit/parallel/xp_degree.py) is a dimension of the real device mesh the layout
builds on 4 processes, and the layout's facts come out as the file declares them: its ranks hold the same
sequences, each adds its loss, and FSDP shards over dp_shard alone."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from keel.config import ParallelConfig, load_config
from keel.config.sections import SECTIONS
from keel.parallel.degrees import DEGREES, resolve_degrees
from keel.parallel.layout import Layout
from keel.parallel.mesh import destroy_distributed, init_distributed
from tests.conftest import free_port
from tests.package_files import added_module

pytestmark = pytest.mark.dist

XP_DEGREE = Path(__file__).parents[1] / "unit" / "parallel" / "xp_degree.py"
WORLD = 4


def layout_facts(where: Path) -> dict:
    """This rank's layout with dp_shard = 2 and xp = 2, as the layout answers it."""
    with added_module("keel.parallel.dims", "xp", XP_DEGREE.read_text(), where, DEGREES, SECTIONS[ParallelConfig]):
        cfg = load_config(None, ["parallel.xp=2", "train.global_batch=8", "train.micro_batch=2",
                                 "eval.sequences=8"])
        ctx = init_distributed(torch.device("cpu"))
        try:
            layout = Layout.build("cpu", resolve_degrees(cfg, WORLD))
            facts = {"rank": ctx.rank, "dims": list(layout.mesh.mesh_dim_names or ()),
                     "shape": list(layout.mesh.shape), "xp_ranks": layout.mesh["xp"].mesh.tolist(),
                     "fsdp_dims": list(layout.fsdp.mesh_dim_names or ()), "fsdp_ranks": layout.fsdp.mesh.tolist(),
                     "dp": layout.dp, "dp_rank": layout.dp_rank, "loss_divisor": layout.loss_divisor,
                     "shards_parameters": layout.shards_parameters}
        finally:
            destroy_distributed()
    return facts


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(layout_facts(Path(out) / f"added-{rank}")))


@pytest.mark.timeout(180)
def test_an_added_degree_is_a_dimension_of_the_mesh_with_the_facts_it_declares(tmp_path: Path) -> None:
    mp.start_processes(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True, start_method="spawn")
    for rank in range(WORLD):
        facts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert facts["dims"] == ["pp", "dp_replicate", "dp_shard", "cp", "tp", "xp"], "innermost, after tp"
        assert facts["shape"] == [1, 1, 2, 1, 1, 2]
        pair = rank - rank % 2
        assert facts["xp_ranks"] == [pair, pair + 1], "consecutive ranks: the innermost dimension"
        assert facts["fsdp_dims"] == ["dp_shard"] and facts["fsdp_ranks"] == [rank % 2, rank % 2 + 2], \
            "FSDP does not shard over xp"
        assert (facts["dp"], facts["dp_rank"]) == (2, rank // 2), "the ranks of an xp group share their sequences"
        assert facts["loss_divisor"] == 4, "every rank of dp_shard × xp adds its mean loss"
        assert facts["shards_parameters"]
