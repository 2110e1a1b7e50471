"""Context parallelism, parallel.cp: each sequence split over cp ranks, two chunks each placed head-tail, the
attention exchanging keys and values between them (keel.parallel.context). Its ranks hold the same sequences;
they are data-parallel for the parameters, so FSDP shards over dp_shard × cp, and each adds the mean loss of its
own tokens to the step's sum."""

from __future__ import annotations

from typing import Any

from keel.config import Config, ParallelConfig, option
from keel.errors import ConfigError
from keel.parallel.degrees import Degrees, degree


def check_config(cfg: Config, cp: int) -> None:
    """What runs beside context parallelism: its own attention, and no loss that needs whole sequences."""
    if cp > 1 and cfg.model.sdpa_backend != "auto":
        raise ConfigError(f"model.sdpa_backend = {cfg.model.sdpa_backend!r} chooses SDPA's kernel, but parallel.cp = "
                          f"{cp} runs keel's own context-parallel attention; set model.sdpa_backend = 'auto' or "
                          f"parallel.cp = 1")
    moe = cfg.model.moe
    if moe.experts and moe.aux_loss_coeff and cp > 1:
        raise ConfigError(f"model.moe.aux_loss_coeff = {moe.aux_loss_coeff} with parallel.cp = {cp}: the "
                          f"sequence-wise balance loss needs each whole sequence's routing, and a context-parallel "
                          f"rank holds a share of it; use the bias update (model.moe.bias_update_rate) or cp = 1")


def check(cfg: Config, degrees: Degrees) -> None:
    """Each sequence into 2 × cp chunks, each rank's share over tensor parallel's sequence parallelism."""
    seq_len, cp, tp = cfg.train.seq_len, degrees.cp, degrees.tp
    if seq_len % (2 * cp):
        raise ConfigError(f"train.seq_len = {seq_len} must divide by 2 × parallel.cp = {2 * cp} (each sequence "
                          f"is cut into 2 × cp chunks, two per context-parallel rank)")
    if cp > 1 and (seq_len // cp) % tp:
        raise ConfigError(f"train.seq_len / parallel.cp = {seq_len // cp} must divide by parallel.tp = {tp}")


def split_sequences(model: Any, layout: Any, cfg: ParallelConfig) -> list[tuple[Any, Any]]:
    """The model computes this rank's share of every sequence (`layout.context`), eagerly inside compiled
    blocks."""
    if cfg.compile:
        layout.context.run_eagerly()
    model.split_context(layout.context)
    return []


CP = degree(
    "cp", option(1, "context-parallel degree: each sequence split over this many ranks (two chunks each, placed "
                 "head-tail), attention exchanging keys and values between them", ge=1),
    after="dp_shard", parameters="shard", in_loss=True,
    check_config=check_config, check=check, apply=split_sequences, hook="split_context")
