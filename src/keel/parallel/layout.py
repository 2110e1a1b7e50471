"""The one owner of a run's parallel layout: its degrees (keel.parallel.degrees), the device mesh built once from
them, and every fact derived from the two — which mesh each feature uses, which ranks share a batch, a loss or the
parameters. Nothing else recomputes a layout fact: the model's parallelisation, the loader, the step's loss and
its one reduction, the guards and the checkpoints ask this object.

The mesh's dimensions and the facts derived from them are what each degree declares (keel.parallel.degrees): with
keel's own degrees and context parallelism's, pp, dp_replicate, dp_shard, cp, tp, outermost first. Ranks of one
tensor- or context-parallel group hold the same sequences (the global batch is split over dp_replicate ×
dp_shard); the context-parallel ranks hold different parts of them and are data-parallel for the parameters, so
FSDP shards parameters over dp_shard × cp (as torchtitan does) and averages their gradients over both. Expert
parallelism borrows its ranks from the same dp_shard × cp: each ep consecutive ones split a mixture-of-experts
model's routed experts, and the ranks left over shard each expert group with FSDP (`experts`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from keel.config import TrainConfig
from keel.core.torch_private import flatten_mesh, unflatten_mesh
from keel.model.loss import Objective
from keel.parallel.context import ContextShard
from keel.parallel.degrees import Degrees


@dataclass(frozen=True)
class Layout:
    degrees: Degrees
    mesh: DeviceMesh

    @classmethod
    def build(cls, device_type: str, degrees: Degrees) -> Layout:
        dims = degrees.dims
        mesh = init_device_mesh(device_type, tuple(degrees.of(dim) for dim in dims), mesh_dim_names=dims)
        return cls(degrees, mesh)

    def describe(self) -> str:
        return self.degrees.describe()

    # ---------------------------------------------------------------- which features run
    @property
    def tensor_parallel(self) -> bool:
        """Whether the model's layers are split over a tensor-parallel group; its logits are then sharded over the
        vocabulary and the loss is computed on the shards."""
        return self.degrees.tp > 1

    @property
    def pipelined(self) -> bool:
        return self.degrees.pp > 1

    @property
    def shards_parameters(self) -> bool:
        """Whether FSDP (HSDP across replicas) holds the parameters: any degree it shards or replicates over."""
        return self.degrees.product(lambda spec: bool(spec.parameters)) > 1

    # ---------------------------------------------------------------- meshes
    @property
    def tp(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def pp(self) -> DeviceMesh:
        return self.mesh["pp"]

    @property
    def pp_rank(self) -> int:
        return self.mesh.get_local_rank("pp")

    @functools.cached_property
    def fsdp(self) -> DeviceMesh:
        """Where parameters are sharded: dp_shard (with the other degrees FSDP shards over, cp's, all as one
        dimension), 2-D (replicate, shard) for HSDP. Built once: a flattened dimension is named once per mesh."""
        d = self.degrees
        shard = tuple(spec.name for spec in d.specs if spec.parameters == "shard" and d.named(spec))
        name = "_".join(shard)
        flat = self.mesh[name] if len(shard) == 1 else flatten_mesh(self.mesh[shard], name)
        return self.mesh["dp_replicate", name] if d.dp_replicate > 1 else flat

    @property
    def expert_parallel(self) -> bool:
        """Whether a mixture-of-experts model's routed experts are split over expert-parallel groups."""
        return self.degrees.ep > 1

    @functools.cached_property
    def experts(self) -> DeviceMesh:
        """The data-parallel ranks (dp_replicate × dp_shard × cp, in mesh order) regrouped as (edp_replicate,
        efsdp, ep): every ep consecutive ranks of dp_shard × cp split the experts between them, and the ranks that
        hold the same experts (efsdp, with edp_replicate's replicas for HSDP) shard them as FSDP does."""
        d = self.degrees
        flat = flatten_mesh(self.mesh["dp_replicate", "dp_shard", "cp"], "dp_all")
        return unflatten_mesh(flat, (d.dp_replicate, d.dp_shard * d.cp // d.ep, d.ep),
                              ("edp_replicate", "efsdp", "ep"))

    @property
    def ep(self) -> DeviceMesh:
        return self.experts["ep"]

    @property
    def expert_fsdp(self) -> DeviceMesh:
        """Where the experts' shards are sharded further (and replicated across HSDP's replicas)."""
        return self.experts["edp_replicate", "efsdp"] if self.degrees.dp_replicate > 1 else self.experts["efsdp"]

    @property
    def replicas(self) -> DeviceMesh | None:
        """The ranks that hold the same parameter shards (HSDP's replicas), None without replicas."""
        return self.mesh["dp_replicate"] if self.degrees.dp_replicate > 1 else None

    @functools.cached_property
    def context(self) -> ContextShard | None:
        """This rank's share of every sequence under context parallelism (None without it)."""
        if self.degrees.cp == 1:
            return None
        cp = self.mesh["cp"]
        return ContextShard(cp.get_group(), cp.get_local_rank(), self.degrees.cp)

    # ---------------------------------------------------------------- batches and losses
    @property
    def dp(self) -> int:
        """How many ways the global batch is split."""
        return self.degrees.dp

    @functools.cached_property
    def dp_rank(self) -> int:
        """This rank's slice of the global batch, its place among the degrees that split the batch (dp_replicate,
        dp_shard; the ranks of one tensor- or context-parallel group share it)."""
        rank = 0
        for spec in self.degrees.specs:
            if spec.in_mesh and spec.splits_batch:
                rank = rank * self.degrees.of(spec.name) + self.mesh.get_local_rank(spec.name)
        return rank

    @property
    def loss_divisor(self) -> int:
        """How many ranks' mean losses the step's one sum holds, over which it is averaged: every data- and
        context-parallel rank holds the mean of as many tokens, the ranks of a tensor-parallel group the same
        one (with a pipeline, the ranks of its last stage; the others add 0): the degrees that count in the loss."""
        return self.degrees.product(lambda spec: spec.in_loss)

    def objective(self, train: TrainConfig) -> Objective:
        """The training objective as this layout computes it: on vocabulary shards under tensor parallelism, over
        this rank's positions of each sequence under context parallelism."""
        return Objective.of(train, vocab_parallel=self.tensor_parallel,
                            split=None if self.context is None else self.context.split)
