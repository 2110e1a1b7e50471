"""What the planner plans: a parallel layout, and the workload it runs (model, sequence, batch, tokens)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from keel.config import ModelConfig
from keel.model.flops import flops_per_token, param_count


@dataclass(frozen=True)
class Layout:
    tp: int = 1  # tensor parallel (with sequence parallel when sp)
    pp: int = 1  # pipeline stages across ranks
    v: int = 1  # stages (model chunks) per pipeline rank: an interleaved schedule when > 1
    dp_shard: int = 1  # FSDP sharding degree
    dp_replicate: int = 1  # HSDP replicas
    micro_batch: int = 1  # sequences per micro-batch per rank
    ac: str = "none"  # activation checkpointing: none | selective | full
    sp: bool = True  # sequence parallel alongside tp > 1

    def gpus(self) -> int:
        return self.tp * self.pp * self.dp_shard * self.dp_replicate

    def dp(self) -> int:
        return self.dp_shard * self.dp_replicate

    def describe(self) -> str:
        parts = [f"{name}{value}" for name, value in (("tp", self.tp), ("pp", self.pp), ("dp_shard", self.dp_shard),
                                                       ("dp_replicate", self.dp_replicate)) if value > 1]
        if self.v > 1:
            parts.append(f"v{self.v}")
        parts.append(f"mb{self.micro_batch}")
        if self.ac != "none":
            parts.append(f"ac={self.ac}")
        return " ".join(parts)


@dataclass(frozen=True)
class Workload:
    model: ModelConfig
    seq_len: int
    global_batch: int  # sequences per optimizer step
    tokens: float = 0.0  # the run's token budget
    param_dtype: str = "bf16"

    @cached_property
    def n_params(self) -> int:
        return param_count(self.model)

    @cached_property
    def flops_per_token(self) -> float:
        return flops_per_token(self.model, self.seq_len)

    def micro_batches(self, layout: Layout) -> int:
        """Micro-batches per step on each pipeline (each data-parallel rank)."""
        return max(1, self.global_batch // (layout.dp() * layout.micro_batch))

    def steps(self) -> int:
        return max(1, round(self.tokens / (self.global_batch * self.seq_len)))
