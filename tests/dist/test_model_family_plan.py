"""A model family keel.parallel has never seen is parallelised by its own declared plan: tensor parallel over
2 gloo processes, with activation checkpointing over its blocks, computes the loss and gradients of the same
model in one process."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from keel.config import load_config
from keel.model.parallelizable import ParallelPlan
from keel.parallel.apply import parallelize
from keel.parallel.degrees import resolve_degrees
from keel.parallel.layout import Layout
from keel.parallel.mesh import destroy_distributed, init_distributed
from tests.conftest import free_port

pytestmark = pytest.mark.dist

VOCAB, DIM, HIDDEN = 24, 16, 32


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc_in = nn.Linear(DIM, HIDDEN)
        self.fc_out = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.LayerNorm(DIM)
        self.mlp = Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.pre(x))


class TinyMixerLM(nn.Module):
    """Laid out unlike Llama: other module names, blocks in `trunk` under names that are not numbers, the MLP
    one level down in each block, a bias, LayerNorm, and plain tensor parallel (replicated activations)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.trunk = nn.ModuleDict({name: Mixer() for name in ("first", "second", "third")})
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.trunk.values():
            x = block(x)
        return self.head(x)

    def blocks(self) -> nn.ModuleDict:
        return self.trunk

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(
            top={"embed": RowwiseParallel(input_layouts=Replicate()), "head": ColwiseParallel(output_layouts=Replicate())},
            block={"mlp.fc_in": ColwiseParallel(), "mlp.fc_out": RowwiseParallel()},
        )


def loss_and_grads(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        grads[unwrapped(name)] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
    return loss.detach(), grads


def unwrapped(name: str) -> str:
    """A parameter's name without activation checkpointing's wrapper in it."""
    return name.replace("._checkpoint_wrapped_module", "")


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.manual_seed(0)
    reference = TinyMixerLM()
    model = copy.deepcopy(reference)
    cfg = load_config(None, ["parallel.tp=2", "parallel.dp_shard=1", "parallel.activation_checkpoint=full"])
    init_distributed(torch.device("cpu"))
    layout = Layout.build("cpu", resolve_degrees(cfg, 2))
    try:
        parallelize(model, layout, cfg.parallel, torch.float32)
        loss, grads = loss_and_grads(model)
        local_shapes = {unwrapped(name): tuple(p.to_local().shape) for name, p in model.named_parameters()
                        if isinstance(p, DTensor)}
        wrapped = [isinstance(block, CheckpointWrapper) for block in model.trunk.values()]
    except BaseException:
        destroy_distributed(wait_for_peers=False)
        raise
    destroy_distributed()
    single_loss, single_grads = loss_and_grads(reference)
    torch.save({"loss": loss, "grads": grads, "single_loss": single_loss, "single_grads": single_grads,
                "local_shapes": local_shapes, "wrapped": wrapped}, f"{out}.{rank}")


@pytest.mark.timeout(120)
def test_a_model_family_unknown_to_keel_parallel_is_tensor_parallel_by_its_own_plan(tmp_path: Path) -> None:
    out = tmp_path / "result.pt"
    mp.start_processes(_worker, args=(free_port(), str(out)), nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        r = torch.load(f"{out}.{rank}")
        assert r["wrapped"] == [True, True, True]
        # Every planned module is split in two; the LayerNorms, which the plan does not name, are not.
        for block in ("first", "second", "third"):
            assert r["local_shapes"][f"trunk.{block}.mlp.fc_in.weight"] == (HIDDEN // 2, DIM)
            assert r["local_shapes"][f"trunk.{block}.mlp.fc_in.bias"] == (HIDDEN // 2,)
            assert r["local_shapes"][f"trunk.{block}.mlp.fc_out.weight"] == (DIM, HIDDEN // 2)
        assert r["local_shapes"]["embed.weight"] == (VOCAB // 2, DIM)
        assert r["local_shapes"]["head.weight"] == (VOCAB // 2, DIM)
        assert not any(".pre." in name for name in r["local_shapes"])
        torch.testing.assert_close(r["loss"], r["single_loss"], rtol=1e-6, atol=1e-6)
        assert r["grads"].keys() == r["single_grads"].keys()
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, r["single_grads"][name], rtol=1e-5, atol=1e-6, msg=name)
