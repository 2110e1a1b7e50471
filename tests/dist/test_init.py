"""1 vs 2 processes start from bitwise-identical weights: FSDP2-sharded init equals the one-process init."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from keel.config import load_config
from keel.parallel.degrees import resolve_degrees
from keel.parallel.layout import Layout
from keel.parallel.mesh import destroy_distributed, init_distributed
from keel.train.setup import build_model_parts
from tests.conftest import SMALL_RUN, free_port

pytestmark = pytest.mark.dist


def full_weight_digests(world_size: int, overrides: list[str]) -> dict[str, str]:
    cfg = load_config(None, SMALL_RUN + overrides)
    ctx = init_distributed(torch.device("cpu"))
    try:
        assert ctx.world_size == world_size
        model = build_model_parts(cfg, Layout.build("cpu", resolve_degrees(cfg, world_size)), torch.float32)[0][0]
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        digests = {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest() for k, v in state.items()}
    except BaseException:
        destroy_distributed(wait_for_peers=False)
        raise
    destroy_distributed()
    return digests


def _worker(rank: int, world_size: int, port: int, out: str, overrides: list[str]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    digests = full_weight_digests(world_size, overrides)
    if rank == 0:
        torch.save(digests, out)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tied", [False, True])
def test_two_process_sharded_init_equals_one_process_init(tmp_path: Path, tied: bool) -> None:
    overrides = [f"model.tie_embeddings={str(tied).lower()}"]
    out = tmp_path / "digests.pt"
    mp.start_processes(_worker, args=(2, free_port(), str(out), overrides), nprocs=2, join=True,
                       start_method="spawn")
    sharded = torch.load(out)
    assert not dist.is_initialized()
    single = full_weight_digests(1, overrides)
    assert (single["output.weight"] == single["tok_embeddings.weight"]) == tied
    assert sharded.keys() == single.keys() and len(single) > 0
    assert sharded == single
