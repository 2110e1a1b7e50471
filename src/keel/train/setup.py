"""What the Trainer builds on: the run directory lock, the model parts, the validation set's size."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import keel
from keel.checkpoint.identity import run_identity
from keel.checkpoint.manager import CheckpointManager
from keel.checkpoint.memory import memory_tier
from keel.checkpoint.resume import checkpoint_root
from keel.config import Config
from keel.core import generations
from keel.core.callbacks import Callback, Hooks
from keel.core.state import TrainState
from keel.data.loader import GlobalOrderLoader, SequenceIndex, validation_batches
from keel.data.shards import Corpus
from keel.data.tokenizer import open_tokenizer
from keel.errors import DataError, KeelError
from keel.health.preflight import run_preflight, verdict
from keel.model.attention import probe, resolve_backend
from keel.model.float8 import convert_to_float8
from keel.model.flops import head_size, param_count
from keel.model.init import init_weights
from keel.model.llama import Llama
from keel.model.loss import Objective
from keel.parallel.apply import parallelize
from keel.parallel.layout import Layout
from keel.parallel.mesh import Dist
from keel.rundir.events import EventLog, host
from keel.rundir.lock import RunLock
from keel.train.master import Bf16Params
from keel.train.reuse import remember, reused
from keel.train.step import Stepper, evaluate


def attempt_started() -> float:
    """When this start of the run began, for the goodput ledger: the launcher's start for its first worker
    group, this process's own for a group the agent restarted or for a plain torchrun job (when each
    first imported keel: the kernel's process start times are rounded to the second), and for a generation
    that replaced a killed worker (keel.core.generations) its start (a survivor's: when it began to rejoin)."""
    launched = os.environ.get("KEEL_LAUNCHED_AT")
    if launched and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and not generations.joined():
        return float(launched)
    return keel.STARTED


def lock_in_rank0(run_dir: Path, rank: int) -> RunLock | None:
    lock, error = None, ""
    if rank == 0:
        try:
            lock = RunLock(run_dir).acquire()
        except KeelError as e:
            error = str(e)
    shared = [error]
    dist.broadcast_object_list(shared, src=0)
    if shared[0]:
        raise KeelError(shared[0])
    return lock


def preflight(cfg: Config, run_dir: Path, ctx: Dist, users: list[Callback], events: EventLog,
              say: Callable[[str], None], job: list | None) -> int | None:
    """The preflight checks (keel.health.preflight); an exit code when this node must be left out. A restart
    of the same job (`job`, keel.train.reuse) reuses the last checks that passed when nothing they depend on
    changed; a drill's corrupted probe always runs."""
    if cfg.health.preflight == "off":
        return None
    probes = [cb.corrupt_probe for cb in users if hasattr(cb, "corrupt_probe")]
    storage = checkpoint_root(cfg, run_dir).path()
    depends = None if probes or job is None else {
        "job": job, "device": str(ctx.device), "checkpoint_dir": storage, "keep_last": cfg.checkpoint.keep_last,
        "probe_mib": cfg.health.preflight_probe_mib, "min_host_memory_gib": cfg.health.min_host_memory_gib}
    if (kept := reused(run_dir, "preflight", depends)) is not None:
        if ctx.rank == 0:
            events.emit("preflight", 0, "passed", mode=cfg.health.preflight, checks=kept["value"],
                        reused=kept["time"])
        say(f"preflight: passed at this job's last start ({time.time() - kept['time']:.0f} s ago) on the same hosts "
            f"and storage; not repeated")
        return None
    checks = run_preflight(cfg, storage, param_count(cfg.model), events, say,
                           corrupt=probes[0] if probes else None, device=ctx.device)
    if all(c.ok for c in checks):
        remember(run_dir, "preflight", depends, [asdict(c) for c in checks])
    code = verdict(checks, cfg.health.preflight, run_dir, ctx.rank)
    if code is not None:
        say(f"error: preflight failed; the nodes at fault are in {run_dir / 'quarantine.json'}; exiting with code "
            f"{code} so that the job goes on without them")
    return code


def gather_hosts(world_size: int) -> list[str]:
    """Each rank's host name, by rank."""
    hosts: list = [None] * world_size
    dist.all_gather_object(hosts, host())
    return hosts


def precision_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    return torch.bfloat16 if cfg.train.compute_precision(device.type) == "bf16" else torch.float32


PROBE_SEQ = 4096  # the attention's kernel is chosen on at most this many positions: its mask stays small


def attention_kernel(cfg: Config, layout: Layout, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The attention's kernel as the start names it (model.sdpa_backend, or torch's pick for auto, for this rank's
    heads, the run's dtype and mask); one the device cannot run is a one-line ConfigError, raised at start."""
    if layout.degrees.cp > 1:  # keel's own attention: SDPA's CPU flash kernel per block, else an fp32 computation
        return {"backend": "context-parallel", "blocks": "flash" if device.type == "cpu" else "math (fp32)"}
    m, tp = cfg.model, layout.degrees.tp
    q, k, v, mask = probe(1, m.n_heads // tp, m.n_kv_heads // tp, min(cfg.train.seq_len, PROBE_SEQ), head_size(m),
                          dtype, device, cfg.data.document_mask)
    return {"backend": resolve_backend(m.sdpa_backend, q, k, v, mask), "asked": m.sdpa_backend,
            "dtype": str(dtype).removeprefix("torch."), "device": device.type, "masked": mask is not None}


def mask_documents(cfg: Config, parts: list[nn.Module], corpus: Corpus) -> None:
    """With data.document_mask, every part attends within documents, each starting with the corpus's BOS."""
    if cfg.data.document_mask:
        for part in parts:
            cast(Llama, part).mask_documents(int(corpus.manifest["tokenizer"]["bos"]), cfg.data.document_positions)


def stepper(cfg: Config, parts: Sequence[nn.Module], optimizers: list[torch.optim.Optimizer], pipeline: Any,
            autocast: torch.dtype | None, objective: Objective) -> tuple[Stepper, Callable[..., Any]]:
    """What makes a training step, and what evaluates the validation batches, on these parts."""
    bf16 = Bf16Params(list(parts)) if cfg.train.param_dtype == "bf16" else None
    made = Stepper(list(parts), optimizers, pipeline, grad_clip=cfg.optim.grad_clip, autocast_dtype=autocast,
                   objective=objective, bf16_params=bf16)
    if pipeline is not None:
        return made, partial(pipeline.evaluate)
    return made, partial(evaluate, parts[0], autocast_dtype=autocast, objective=objective, bf16_params=bf16)


def build_model_parts(cfg: Config, layout: Layout, param_dtype: torch.dtype) -> tuple[list[Llama], list[int]]:
    """The model, or this rank's pipeline stages and their stage numbers, parallelised and initialised."""
    with torch.device("meta"):
        model = Llama(cfg.model)
    if not layout.pipelined:
        parts, stages = [model], [0]
    else:
        from keel.parallel.pipeline import stage_ids, stage_module  # torch's pipelining loads torch._dynamo

        stages = stage_ids(layout.pp_rank, layout.degrees.pp, cfg.parallel.pp_stages_per_rank)
        n_stages = layout.degrees.pp * cfg.parallel.pp_stages_per_rank
        parts = [stage_module(model, stage, n_stages) for stage in stages]
    for part in parts:
        if cfg.train.precision == "fp8":
            convert_to_float8(part, cfg.train.float8_recipe, emulate=layout.mesh.device_type != "cuda",
                              fsdp=layout.shards_parameters)
        parallelize(part, layout, cfg.parallel, param_dtype)
        part.to_empty(device=layout.mesh.device_type)
        init_weights(part, cfg.train.seed)
    return parts, stages




def checkpoint_manager(cfg: Config, run_dir: Path, layout: Layout, events: EventLog, hooks: Hooks, corpus: Corpus,
                       accepted: tuple[str, ...]) -> CheckpointManager:
    return CheckpointManager(
        cfg, run_dir, layout.describe(), events, on_write=partial(hooks.notify, "on_checkpoint_write"),
        # Where the tokenizer's file lies, for `keel ckpt export` to find it (its sha256 says it is the same).
        tokenizer={**corpus.manifest["tokenizer"], "corpus": str(corpus.dir.resolve())},
        identity=run_identity(cfg, corpus.fingerprint, corpus.manifest["tokenizer"]), accepted=accepted,
        memory=memory_tier(cfg))


def load_initial_weights(parts: list[torch.nn.Module], init_from: str, say: Callable[[str], None]) -> None:
    """A fresh run's weights from a Hugging Face directory (model.init_from = "hf:DIR")."""
    from keel.checkpoint.export import load_hf_weights

    for part in parts:
        assert isinstance(part, Llama)
        load_hf_weights(part, Path(init_from.removeprefix("hf:")))
    say(f"initialised the weights from {init_from}")


def validation_text(corpus: Corpus, seq_len: int, val_sequences: int) -> tuple[int, int]:
    """Target tokens of the fixed validation set and the UTF-8 bytes they stand for, so that its bits per
    byte are exact whatever the tokenizer (training's use the training split's average bytes per token)."""
    token_bytes = open_tokenizer(corpus.dir, corpus.manifest["tokenizer"]).token_bytes()
    targets = SequenceIndex(corpus.splits["val"], seq_len).tokens(np.arange(val_sequences))[:, 1:]
    return targets.size, int(token_bytes[targets].sum())


def run_summary(cfg: Config, state: TrainState, corpus: Corpus, train_loss: float, val_loss: float, val_bpb: float,
                run_dir: Path, checkpoint: str | None) -> dict:
    """What summary.json says of a finished run."""
    return {"name": cfg.name, "step": state.step, "train_loss": train_loss, "val_loss": val_loss, "val_bpb": val_bpb,
            "tokenizer": corpus.manifest["tokenizer"]["name"],
            "unigram_entropy": corpus.manifest["stats"]["unigram_entropy_nats"], "tokens_seen": state.tokens_seen,
            "train_seconds": round(state.train_seconds, 2),
            "tokens_per_s": state.tokens_seen / max(state.train_seconds, 1e-9), "run_dir": str(run_dir),
            "checkpoint": checkpoint}


def validated_loss(sums: tuple[torch.Tensor, torch.Tensor]) -> float:
    # Ranks of one tensor-parallel group see the same batches: the sums scale alike, the mean is right.
    both = torch.stack(sums)
    dist.all_reduce(both)
    return (both[0] / both[1]).item()


class LoaderState:
    """The data cursor as the train state saves it; a resume may accept a corpus change on purpose."""

    def __init__(self, loader: GlobalOrderLoader, allow_corpus_change: bool) -> None:
        self.loader, self.allow_corpus_change = loader, allow_corpus_change

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state, self.allow_corpus_change)


@dataclass
class Data:
    """The run's data: the training loader (and its state as the checkpoint saves it), the validation
    batches, and the token and byte counts bits per byte are computed from."""

    loader: GlobalOrderLoader
    loader_state: LoaderState
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    val_text: tuple[int, int]
    train_text: tuple[int, int]


def build_data(cfg: Config, layout: Layout, corpus: Corpus, accepted: tuple[str, ...]) -> Data:
    if set(corpus.sources) != set(cfg.data.sources):
        raise DataError(f"data.dir {cfg.data.dir} holds the sources {', '.join(corpus.sources)}, the config "
                        f"names {', '.join(cfg.data.sources)}; name them alike in [data.sources] or prepare the "
                        f"corpus again")
    loader = GlobalOrderLoader(
        corpus.sources, weights={name: s.weight for name, s in cfg.data.sources.items()},
        schedule=[(p.step, p.weights) for p in cfg.data.schedule], seq_len=cfg.train.seq_len,
        global_batch=cfg.train.global_batch, micro_batch=cfg.train.micro_batch, dp_rank=layout.dp_rank,
        dp_size=layout.dp, seed=cfg.train.seed,
        fingerprint=corpus.fingerprint, prefetch=cfg.data.prefetch, skips=cfg.data.skip_batches)
    val_batches = validation_batches(corpus.splits["val"], seq_len=cfg.train.seq_len, sequences=cfg.eval.sequences,
                                     micro_batch=cfg.train.micro_batch, dp_rank=layout.dp_rank, dp_size=layout.dp)
    return Data(loader, LoaderState(loader, "data.corpus" in accepted), val_batches,
                validation_text(corpus, cfg.train.seq_len, cfg.eval.sequences),
                (corpus.manifest["tokens"]["train"], corpus.manifest["text_bytes"]["train"]))
