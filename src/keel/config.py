"""Typed config tree: TOML files, KEY=VALUE overrides, validation with messages that name the field.

Every field is declared with `option(default, help, ...)`; its type comes from the annotation and
its allowed range from the keywords. The same declarations drive validation and `keel config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keel.errors import ConfigError

INT_MAX = 2**63 - 1  # an integer field's bound unless it has its own: what torch and numpy hold as int64
SEED_MAX = 2**64 - 1  # torch.manual_seed takes seeds up to 64 bits
YEAR_S = 365 * 24 * 3600  # bound of every duration: longer ones overflow the timers that wait on them

def option(default: Any, help: str, *, ge: float | None = None, gt: float | None = None,
           le: float | None = None, choices: tuple[str, ...] | None = None) -> Any:
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    dim: int = option(256, "model width", ge=1)
    n_layers: int = option(4, "number of transformer blocks", ge=1)
    n_heads: int = option(8, "attention heads (dim must divide by it)", ge=1)
    n_kv_heads: int = option(4, "key/value heads for grouped-query attention (n_heads must divide by it)", ge=1)
    vocab_size: int = option(259, "embedding rows; at least the tokenizer's vocabulary", ge=1)
    ffn_dim_multiplier: float = option(1.0, "scales the SwiGLU hidden size (Llama rule: 8/3·dim)", gt=0)
    multiple_of: int = option(64, "SwiGLU hidden size is rounded up to a multiple of this", ge=1)
    norm_eps: float = option(1e-5, "RMSNorm epsilon", gt=0)
    rope_theta: float = option(10000.0, "RoPE base", gt=0)
    max_seq_len: int = option(256, "longest sequence the RoPE tables cover", ge=1)
    tie_embeddings: bool = option(False, "share the input embedding with the output projection")
    init_from: str = option("", "start a fresh run from these weights instead of random ones: `hf:PATH`, a "
                            "Hugging Face Llama directory (config.json + model.safetensors)")


@dataclass
class SourceConfig:
    paths: list[str] = option(["stdlib"], "files, directories and globs (.txt, .py, .md, .jsonl, .jsonl.gz, .parquet), "
                              "or 'stdlib' (the running interpreter's standard library sources)")
    weight: float = option(1.0, "share of every global batch drawn from this source (weights are normalised)",
                           ge=0)


@dataclass
class MixturePhase:
    step: int = option(0, "the steps after this many steps draw their global batches with `weights` (skipped "
                       "batches count)", ge=0)
    weights: dict[str, float] = option({}, "source name → weight for this phase (normalised); a source left out "
                                       "weighs 0")


@dataclass
class CleanConfig:
    enabled: bool = option(True, "run the cleaning filters (off: only normalisation of line ends)")
    unicode_form: str = option("NFC", "Unicode normalisation of every document", choices=("NFC", "NFKC", "none"))
    strip_control: bool = option(True, "remove control characters other than tab, newline and carriage return")
    min_chars: int = option(32, "documents shorter than this (after cleaning) are removed", ge=0)
    max_chars: int = option(1_000_000, "documents longer than this are removed", ge=1)
    max_duplicate_line_fraction: float = option(0.3, "remove a document whose repeated lines make up more than this "
                                                "share of its lines (Gopher); 1 turns it off", ge=0, le=1)
    max_code_duplicate_line_fraction: float = option(0.6, "the same for code, counting lines longer than 10 "
                                                     "characters (code repeats short lines by nature)", ge=0, le=1)
    max_top_ngram_share: float = option(0.2, "remove prose whose most frequent word 2-gram covers more than this "
                                        "share of its characters (Gopher); 1 turns it off", ge=0, le=1)
    min_alpha_fraction: float = option(0.5, "remove prose with fewer letters than this share of its non-space "
                                       "characters", ge=0, le=1)
    max_symbol_fraction: float = option(0.1, "remove prose where '#' and '...' outnumber words by more than this",
                                        ge=0)
    min_code_alnum_fraction: float = option(0.25, "remove code with fewer letters and digits than this share of "
                                            "its characters", ge=0, le=1)
    strip_license_headers: bool = option(True, "remove the leading licence/copyright comment block of code files")
    drop_generated: bool = option(True, "remove code files marked as generated ('DO NOT EDIT', 'autogenerated')")
    samples: int = option(20, "removed documents kept per filter for inspection (removed/<filter>.jsonl)", ge=0)


@dataclass
class DedupConfig:
    exact: bool = option(True, "remove documents whose normalised text (case and whitespace folded) repeats")
    near: bool = option(True, "remove near-duplicates found by MinHash-LSH, keeping one document per cluster")
    threshold: float = option(0.8, "Jaccard similarity of shingle sets from which documents are near-duplicates",
                              gt=0, le=1)
    num_perm: int = option(128, "MinHash permutations per document", ge=2)
    shingle: str = option("word", "shingles: word or character n-grams", choices=("word", "char"))
    ngram: int = option(5, "shingle length in words or characters", ge=1)
    bands: int = option(0, "LSH bands; 0: chosen with rows from the threshold (see `keel data stats`)", ge=0)
    rows: int = option(0, "LSH rows per band; 0: chosen with bands from the threshold", ge=0)
    seed: int = option(1, "seed of the MinHash permutations", ge=0, le=SEED_MAX)


@dataclass
class DecontamConfig:
    enabled: bool = option(True, "remove training documents sharing a long n-gram with the validation split or "
                           "eval_files")
    ngram: int = option(13, "n-gram length in words", ge=1)
    eval_files: list[str] = option([], "evaluation sets to protect: files, directories or globs, read like sources")


@dataclass
class DataConfig:
    dir: str = option("data/stdlib", "directory of prepared token shards (manifest.json inside)")
    sources: dict[str, SourceConfig] = option({"main": SourceConfig()}, "named sources, each a [data.sources.NAME] "
                                              "table of paths and weight; a list of paths is one source named 'main'")
    schedule: list[MixturePhase] = option([], "mixture weight changes, as [[data.schedule]] tables with step and "
                                          "weights (e.g. an annealing phase)")
    tokenizer: str = option("byte", "byte, bpe:VOCAB (trained on the corpus with Hugging Face tokenizers) or the "
                            "path of a tokenizer.json")
    val_fraction: float = option(0.01, "share of documents held out for validation (by document hash)",
                                 gt=0, le=0.5)
    text_field: str = option("text", "the field holding a document's text in .jsonl and .parquet files")
    workers: int = option(0, "processes that read and clean input files in prepare; 0: one per core, up to 8", ge=0)
    shard_tokens: int = option(1 << 28, "tokens per output shard file", ge=1)
    clean: CleanConfig = field(default_factory=CleanConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    decontam: DecontamConfig = field(default_factory=DecontamConfig)
    prefetch: int = option(2, "batches prepared ahead by the background loader thread", ge=1)
    verify_checksums: bool = option(True, "check every shard's sha256 against the manifest at start")
    allow_corpus_change: bool = option(False, "resume even if the corpus fingerprint differs from the checkpoint's")
    skip_batches: list[list[int]] = option([], "global batches never trained on, as [start, end) ranges of batch "
                                           "numbers, e.g. [[1200, 1500]] (a rollback adds its own)")


@dataclass
class TrainConfig:
    steps: int = option(200, "optimizer steps of the whole run", ge=1)
    seq_len: int = option(256, "tokens per training sequence", ge=1)
    global_batch: int = option(32, "sequences per optimizer step, whatever the number of processes", ge=1)
    micro_batch: int = option(16, "sequences per forward/backward on one rank", ge=1)
    seed: int = option(0, "seed for initialisation and data order", ge=0, le=SEED_MAX)
    device: str = option("auto", "where to train (auto: CUDA when present)", choices=("auto", "cpu", "cuda"))
    precision: str = option("auto", "compute precision (auto: fp32 on CPU, bf16 on CUDA)",
                            choices=("auto", "fp32", "bf16"))
    deterministic: bool = option(True, "deterministic kernels (bitwise-reproducible runs)")


@dataclass
class OptimConfig:
    lr: float = option(3e-3, "peak learning rate", gt=0)
    min_lr_ratio: float = option(0.1, "final learning rate as a fraction of the peak", ge=0, le=1)
    schedule: str = option("cosine", "LR schedule after the warmup: cosine decay, warmup-stable-decay, or constant",
                           choices=("cosine", "wsd", "constant"))
    warmup_steps: int = option(20, "linear warmup steps", ge=0)
    decay_fraction: float = option(0.2, "wsd: share of the steps spent decaying at the end", gt=0, le=1)
    weight_decay: float = option(0.1, "AdamW decoupled weight decay (matrices only)", ge=0)
    beta1: float = option(0.9, "AdamW beta1", ge=0, le=1)
    beta2: float = option(0.95, "AdamW beta2", ge=0, le=1)
    eps: float = option(1e-8, "AdamW epsilon", gt=0)
    grad_clip: float = option(1.0, "global gradient-norm clipping threshold (0 disables)", ge=0)


@dataclass
class EvalConfig:
    interval: int = option(50, "steps between validation passes (0: only at the end)", ge=0)
    sequences: int = option(64, "validation sequences per pass, shared out over the processes (the same set "
                            "whatever the layout)", ge=1)


@dataclass
class ParallelConfig:
    dp_replicate: int = option(1, "data-parallel replicas (HSDP: FSDP inside each replica, all-reduce across them)",
                               ge=1)
    dp_shard: int = option(-1, "FSDP sharding degree; -1: the processes left after the other degrees", ge=-1)
    tp: int = option(1, "tensor-parallel degree (with sequence parallel); keep it within a node", ge=1)
    pp: int = option(1, "pipeline-parallel degree: the blocks split into consecutive stages", ge=1)
    pp_schedule: str = option("1f1b", "pipeline schedule: gpipe, 1f1b, interleaved_1f1b or interleaved_zb "
                              "(zero bubble); the interleaved ones need pp_stages_per_rank >= 2",
                              choices=("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb"))
    pp_microbatches: int = option(0, "pipeline micro-batches per step on each data-parallel rank; 0: the global "
                                  "batch per rank divided by train.micro_batch", ge=0)
    pp_stages_per_rank: int = option(1, "pipeline stages each rank holds (2+ for the interleaved schedules)", ge=1)
    activation_checkpoint: str = option("none", "recompute block activations in the backward pass: none, "
                                        "full (every block) or selective (every ac_every-th block)",
                                        choices=("none", "full", "selective"))
    ac_every: int = option(2, "selective activation checkpointing: checkpoint one block in this many", ge=1)
    compile: bool = option(False, "torch.compile each transformer block")
    reduce_dtype: str = option("fp32", "dtype of FSDP gradient reduction (parameters and compute follow "
                               "train.precision)", choices=("fp32", "bf16"))


@dataclass
class AlertsConfig:
    webhook: str = option("", "URL that receives each alert as an HTTP POST of JSON (empty: none); retried with "
                          "backoff from a background thread, never blocking training")
    webhook_timeout_s: float = option(5.0, "seconds one webhook POST may take", gt=0, le=YEAR_S)
    webhook_retries: int = option(3, "further attempts after a failed POST (backoff 1, 2, 4 ... s)", ge=0)
    cooldown_s: float = option(600.0, "an alert rule that fired stays quiet this long (one notice per incident)",
                               ge=0, le=YEAR_S)
    stall_s: float = option(120.0, "a step not finished after this many seconds is stalled (also exported for "
                            "Prometheus' KeelStepStalled rule)", gt=0, le=YEAR_S)
    throughput_drop: float = option(0.7, "alert when tokens/s falls below this fraction of its trailing median",
                                    gt=0, le=1)
    throughput_window: int = option(20, "logged intervals in the trailing median of tokens/s", ge=3)
    throughput_for_s: float = option(300.0, "... for this many seconds in a row", ge=0, le=YEAR_S)
    nan_skip_rate: float = option(0.05, "alert when more than this share of an interval's steps were skipped "
                                  "(non-finite or spiking)", gt=0, le=1)
    checkpoint_overdue: float = option(2.0, "alert when no checkpoint committed for this many expected intervals",
                                       gt=1)
    storage_free: float = option(0.05, "alert when the checkpoint volume's free share falls below this", ge=0, le=1)
    gpu_temp_c: float = option(87.0, "alert when a GPU is hotter than this (°C)", gt=0)
    goodput_target: float = option(0.8, "alert when the run's goodput ratio is below this ...", ge=0, le=1)
    goodput_after_s: float = option(1800.0, "... once the run is older than this many seconds of wall time", ge=0,
                                    le=YEAR_S)


@dataclass
class MonitorConfig:
    interval: int = option(10, "steps between metric reductions across ranks: metrics.jsonl records, progress "
                           "lines, the exporter, TensorBoard and the alert rules over metrics", ge=1)
    peak_flops: str = option("auto", "peak FLOP/s per device for MFU: auto (the accelerator catalog; measured on a "
                             "CPU; unknown devices report MFU as unknown), measure (a matmul probe at start), or "
                             "a number such as 989e12")
    profile_interval: int = option(50, "profile one step in this many to measure time in collectives "
                                   "(0: never)", ge=0)
    telemetry_interval_s: float = option(10.0, "seconds between hardware, network and storage samples of each "
                                         "node (0: no telemetry)", ge=0, le=YEAR_S)
    prometheus_port: int = option(9400, "port of the Prometheus exporter (0: no exporter); with per = rank, rank "
                                  "r of a node serves port + r", ge=0, le=65535)
    prometheus_host: str = option("127.0.0.1", "address the exporter binds (0.0.0.0 to let other hosts scrape)")
    prometheus_per: str = option("node", "node: one exporter per node (local rank 0: the run's metrics, its own "
                                 "rank's, the node's telemetry); rank: one per process", choices=("node", "rank"))
    tensorboard: bool = option(False, "also write TensorBoard event files to RUN_DIR/tensorboard (needs the "
                               "tensorboard extra)")
    alerts: AlertsConfig = field(default_factory=AlertsConfig)


@dataclass
class CheckpointConfig:
    dir: str = option("", "where checkpoints go: a directory or an fsspec URL such as s3://bucket/prefix "
                      "(default: RUN_DIR/checkpoints)")
    policy: str = option("steps", "when to save: steps (every `interval` steps), seconds (every `every_seconds`), "
                         "auto (Young/Daly optimum from the measured save cost and `mtbf_hours`)",
                         choices=("steps", "seconds", "auto"))
    interval: int = option(100, "steps between checkpoints with policy = steps (the last step is always saved)",
                           ge=1)
    every_seconds: float = option(1800.0, "seconds of training between checkpoints with policy = seconds", gt=0,
                                  le=YEAR_S)
    mtbf_hours: float = option(24.0, "mean time between failures of the whole job, for policy = auto (replaced "
                               "by the observed one once the run has been interrupted)", gt=0, le=YEAR_S / 3600)
    async_save: bool = option(True, "write checkpoints in the background; training blocks only while the "
                              "state is copied to host memory")
    keep_last: int = option(3, "checkpoints kept, newest first (older ones are pruned in the background)", ge=1)
    keep_every: int = option(0, "also keep every checkpoint whose step is a multiple of this, permanently "
                             "(0: none)", ge=0)
    verify_on_resume: bool = option(True, "check every file's checksum before resuming; a checkpoint that fails "
                                    "is skipped for the previous one")
    on_storage_error: str = option("continue", "a save the volume refuses (full, quota, read-only, permission, "
                                   "vanished mount): continue with the previous checkpoint kept, or stop with "
                                   "exit 73", choices=("continue", "stop"))


@dataclass
class NumericsConfig:
    on_nonfinite: str = option("skip", "NaN/Inf in the loss or gradients of any rank: skip the update on every "
                               "rank, or stop the run", choices=("skip", "stop"))
    max_consecutive: int = option(3, "skipped updates in a row before the guard rolls back instead", ge=1)


@dataclass
class SpikeConfig:
    response: str = option("rollback", "what a loss or gradient-norm spike does: roll back past its data, skip "
                           "its update, log it, or nothing", choices=("rollback", "skip", "log", "off"))
    window: int = option(100, "recent steps the median and MAD are taken over", ge=4)
    warmup: int = option(50, "steps in the window before spikes are looked for", ge=4)
    loss_threshold: float = option(6.0, "robust score (MADs above the median) of a loss spike; 0: loss not checked",
                                   ge=0)
    grad_threshold: float = option(0.0, "robust score of a gradient-norm spike; 0: gradient norm not checked",
                                   ge=0)
    min_rise: float = option(0.05, "a spike must also rise this fraction above the median", ge=0)


@dataclass
class SdcConfig:
    fingerprint_interval: int = option(50, "steps between comparisons of replicas' parameter and optimizer "
                                       "fingerprints (HSDP replicas; also before every checkpoint); 0: only "
                                       "before checkpoints", ge=0)
    replay_interval: int = option(100, "steps between step replays (forward/backward recomputed and compared "
                                  "bitwise; also whenever the numerics or spike guards fire); 0: only then", ge=0)
    response: str = option("rollback", "on a suspect rank: roll back and go on, or also exit with code 76 so "
                           "that the launcher restarts without its node", choices=("rollback", "exit"))


@dataclass
class GuardConfig:
    enabled: bool = option(True, "run the built-in guards (numerics, spike, SDC) and snapshots")
    snapshot_interval: int = option(50, "steps between in-memory snapshots of the train state (0: none; "
                                    "rollbacks then read disk checkpoints)", ge=0)
    snapshots: int = option(2, "in-memory snapshots kept (each a host copy of this rank's parameters and "
                            "optimizer state)", ge=1)
    rollback_steps: int = option(20, "a rollback returns to a state at least this many steps before the trouble",
                                 ge=1)
    skip_batches: int = option(100, "global batches skipped after a rollback, counted from the state rolled back "
                               "to (always at least through the offending batch)", ge=0)
    lr_scale: float = option(1.0, "learning-rate factor for lr_scale_steps steps after a rollback", gt=0, le=1)
    lr_scale_steps: int = option(0, "steps the learning-rate factor lasts", ge=0)
    max_rollbacks: int = option(3, "rollbacks at the same place (within spike.window steps; each doubles the "
                                "skip) before the run stops", ge=1)
    numerics: NumericsConfig = field(default_factory=NumericsConfig)
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    sdc: SdcConfig = field(default_factory=SdcConfig)


@dataclass
class WatchdogConfig:
    enabled: bool = option(True, "watch every rank for a section (setup, step, checkpoint, eval) that runs past "
                           "its timeout; on a hang dump all stacks to logs/, name the stuck ranks, exit so the "
                           "elastic agent restarts the workers")
    warmup_steps: int = option(20, "steps observed before the step timeout is learned", ge=1)
    factor: float = option(5.0, "a learned timeout is this many times the longest duration observed", gt=1)
    min_timeout_s: float = option(60.0, "floor of every learned timeout (seconds)", gt=0, le=YEAR_S)
    initial_timeout_s: float = option(900.0, "step, eval and checkpoint timeout until learned (seconds)", gt=0,
                                      le=YEAR_S)
    setup_timeout_s: float = option(1800.0, "timeout of setup: process group to the first step (seconds)", gt=0,
                                    le=YEAR_S)
    poll_s: float = option(1.0, "how often the watchdog thread looks at its rank and at the others' hang reports",
                           gt=0, le=YEAR_S)


@dataclass
class StragglerConfig:
    interval: int = option(20, "steps between gathers of every rank's compute time (0: off)", ge=0)
    factor: float = option(1.5, "a rank is slow when its compute time is this many times the median rank's", gt=1)
    patience: int = option(2, "consecutive slow gathers before a rank is reported", ge=1)
    action: str = option("log", "log: event and warning · quarantine: also list its node in quarantine.json and "
                         "exit 76 so the run restarts without it", choices=("log", "quarantine"))


@dataclass
class HealthConfig:
    max_restarts: int = option(0, "worker-group restarts the elastic agent may make (--max-restarts overrides)",
                               ge=0)
    no_progress_restarts: int = option(2, "stop (exit 3, do not requeue) after this many restarts in a row that "
                                       "did not get past the step the run had reached", ge=1)
    rendezvous_timeout_s: int = option(900, "elastic jobs (--nnodes): how long a (re)starting node waits for the "
                                       "others to join; longer than a step's watchdog timeout", ge=1, le=YEAR_S)
    shutdown_grace_s: int = option(120, "seconds the launcher gives the workers to checkpoint after SIGTERM, before "
                                   "SIGKILL", ge=1, le=YEAR_S)
    preflight: str = option("warn", "checks before the first step and after every restart: warn (report and go "
                            "on), fail (end the run naming the node and rank: exit 2 for the checkpoint storage, "
                            "76 with the node quarantined for a node's own fault) or off",
                            choices=("warn", "fail", "off"))
    preflight_probe_mib: int = option(64, "size of the storage and all-reduce probes (MiB)", ge=1)
    min_host_memory_gib: float = option(1.0, "preflight: host memory that must be available (GiB)", ge=0)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)


@dataclass
class DrillConfig:
    inject: list[str] = option([], "faults to inject, `KIND:key=value,...`, e.g. "
                               "\"nan_grads:step=30,rank=1\" (see keel.drill.faults.INJECTORS)")


@dataclass
class CallbackSpec:
    path: str = option("", "import path of a Callback class, `package.module:Class`")
    args: dict = option({}, "keyword arguments for the class")


@dataclass
class Config:
    name: str = option("", "run name; defaults to the config file's stem")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    drill: DrillConfig = field(default_factory=DrillConfig)
    callbacks: list[CallbackSpec] = field(default_factory=list)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- building from dicts

def _type_name(tp: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            dict: "a table"}.get(tp, str(tp).replace("typing.", ""))


def _check_value(path: str, value: Any, tp: Any, meta: typing.Mapping[str, Any]) -> Any:
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{path} = {value!r}: expected a list, each item {_type_name(item_tp)}")
        return [_check_value(f"{path}[{i}]", v, item_tp, {}) for i, v in enumerate(value)]
    if origin is dict:
        value_tp = typing.get_args(tp)[1]
        if not isinstance(value, dict):
            raise ConfigError(f"{path} = {value!r}: expected a table, each value {_type_name(value_tp)}")
        return {k: _check_value(f"{path}.{k}", v, value_tp, {}) for k, v in value.items()}
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str),
          dict: lambda v: isinstance(v, dict)}[tp]
    if not ok(value):
        raise ConfigError(f"{path} = {value!r}: expected {_type_name(tp)}")
    if tp is float:
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{path} = {value!r}: expected a finite number")
    if tp is str:
        _check_text(path, value)
    upper = meta.get("le") if meta.get("le") is not None else INT_MAX if tp is int else None
    bounds = [(meta.get("ge"), ">=", lambda v, b: v >= b), (meta.get("gt"), ">", lambda v, b: v > b),
              (upper, "<=", lambda v, b: v <= b)]
    for bound, _, holds in bounds:
        if bound is not None and not holds(value, bound):
            allowed = " and ".join(f"{s} {b if isinstance(b, int) else f'{b:g}'}" for b, s, _ in bounds
                                   if b is not None)
            raise ConfigError(f"{path} = {value!r} is out of range: must be {allowed}")
    choices = meta.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{path} = {value!r}: expected one of {', '.join(choices)}")
    return value


def _check_text(path: str, value: str) -> None:
    """A string must be writable as UTF-8 (not so a command line's undecodable bytes) and free of NUL, which no
    path, URL or name may hold."""
    try:
        value.encode()
    except UnicodeEncodeError:
        raise ConfigError(f"{path} = {value!r}: not valid UTF-8 text; write it in UTF-8") from None
    if "\0" in value:
        raise ConfigError(f"{path} = {value!r}: a NUL character is not allowed in a string")


def _unknown_key(path: str, key: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(known)}"
    where = f"[{path}]" if path else "the top level"
    return ConfigError(f"unknown config key '{key}' in {where}{hint}")


def _table_type(tp: Any) -> type | None:
    """The value type of a `dict[str, SomeDataclass]` field (named tables such as [data.sources.NAME])."""
    if typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
        return typing.get_args(tp)[1]
    return None


def _build_tables(cls: type, value: Any, path: str) -> dict:
    if isinstance(value, list) and all(isinstance(v, str) for v in value) and cls is SourceConfig:
        value = {"main": {"paths": value}}  # a plain list of paths is one source
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{path} = {value!r}: expected named tables, e.g. [{path}.web]")
    return {name: _build(cls, v, f"{path}.{name}") for name, v in value.items()}


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'} = {data!r}: expected a table")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            raise _unknown_key(path, key, list(fields))
    kwargs = {}
    for key, value in data.items():
        tp, sub = hints[key], f"{path}.{key}" if path else key
        item_tp = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, sub)
        elif (table_tp := _table_type(tp)) is not None:
            kwargs[key] = _build_tables(table_tp, value, sub)
        elif item_tp is not None and dataclasses.is_dataclass(item_tp):
            if not isinstance(value, list):
                raise ConfigError(f"{sub} = {value!r}: expected an array of tables ([[{sub}]])")
            kwargs[key] = [_build(item_tp, v, f"{sub}[{i}]") for i, v in enumerate(value)]
        else:
            kwargs[key] = _check_value(sub, value, tp, fields[key].metadata)
    return cls(**kwargs)


def _check_consistency(cfg: Config) -> None:
    m, t = cfg.model, cfg.train
    if m.init_from and not m.init_from.startswith("hf:"):
        raise ConfigError(f"model.init_from = {m.init_from!r}: expected hf:PATH, a Hugging Face Llama directory")
    if m.dim % m.n_heads:
        raise ConfigError(f"model.dim = {m.dim} must divide by model.n_heads = {m.n_heads}")
    if (m.dim // m.n_heads) % 2:
        raise ConfigError(f"model.dim / model.n_heads = {m.dim // m.n_heads} must be even for RoPE")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_heads = {m.n_heads} must divide by model.n_kv_heads = {m.n_kv_heads}")
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len = {t.seq_len} exceeds model.max_seq_len = {m.max_seq_len}")
    if t.global_batch % t.micro_batch:
        raise ConfigError(f"train.global_batch = {t.global_batch} must divide by train.micro_batch = {t.micro_batch}")
    peak = cfg.monitor.peak_flops
    if peak not in ("auto", "measure"):
        try:
            valid = float(peak) > 0 and math.isfinite(float(peak))
        except ValueError:
            valid = False
        if not valid:
            raise ConfigError(f"monitor.peak_flops = {peak!r}: expected auto, measure, or a positive number of FLOP/s "
                              f"such as 989e12")
    _check_mixture(cfg.data)
    for i, (start, *end) in enumerate(cfg.data.skip_batches):
        if len(end) != 1 or not 0 <= start < end[0]:
            raise ConfigError(f"data.skip_batches[{i}] = {[start, *end]}: expected [start, end] with 0 <= start < end")
    if cfg.guard.spike.warmup > cfg.guard.spike.window:
        raise ConfigError(f"guard.spike.warmup = {cfg.guard.spike.warmup} exceeds guard.spike.window = "
                          f"{cfg.guard.spike.window}: the window must hold the warm-up steps")
    for i, cb in enumerate(cfg.callbacks):
        if ":" not in cb.path:
            raise ConfigError(f"callbacks[{i}].path = {cb.path!r}: expected 'package.module:Class'")


def _check_mixture(data: DataConfig) -> None:
    for name, source in data.sources.items():
        if not name.isidentifier():
            raise ConfigError(f"data.sources.{name}: a source name is letters, digits and underscores, such as web")
        if not source.paths:
            raise ConfigError(f"data.sources.{name}.paths is empty: give files, directories, globs or 'stdlib'")
    phases = [("data.sources", {n: s.weight for n, s in data.sources.items()})]
    phases += [(f"data.schedule[{i}]", p.weights) for i, p in enumerate(data.schedule)]
    for where, weights in phases:
        for name, weight in weights.items():
            if name not in data.sources:
                raise ConfigError(f"{where}: unknown source {name!r}; the sources are {', '.join(data.sources)}")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < math.inf:
                raise ConfigError(f"{where}: weight {name} = {weight!r}: expected a number >= 0")
        if not any(w > 0 for w in weights.values()):
            raise ConfigError(f"{where}: every weight is 0; give at least one source a positive weight")
    d = data.dedup
    if (d.bands == 0) != (d.rows == 0) or d.bands * d.rows > d.num_perm:
        raise ConfigError(f"data.dedup.bands = {d.bands}, rows = {d.rows}: set both (bands × rows <= num_perm = "
                          f"{d.num_perm}) or neither (0: chosen from the threshold)")
    steps = [p.step for p in data.schedule]
    if steps != sorted(set(steps)):
        raise ConfigError(f"data.schedule steps {steps} must increase strictly")
    if data.tokenizer != "byte" and not data.tokenizer.startswith("bpe:") and not data.tokenizer.endswith(".json"):
        raise ConfigError(f"data.tokenizer = {data.tokenizer!r}: expected byte, bpe:VOCAB (e.g. bpe:8192) or the path "
                          f"of a tokenizer.json")


@dataclass(frozen=True)
class Layout:
    """The degrees of a run, resolved for its world size: dp_replicate × dp_shard × tp = world size."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1
    pp_microbatches: int = 0  # pipeline micro-batches per step and data-parallel rank

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ways the global batch is split."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def describe(self) -> str:
        parts = [f"{name}{n}" for name, n in (("pp", self.pp), ("dp_replicate", self.dp_replicate),
                                                ("dp_shard", self.dp_shard), ("tp", self.tp)) if n > 1]
        return " × ".join(parts) if parts else "single process"


def resolve_layout(cfg: Config, world_size: int) -> Layout:
    """Check the layout against the world size and the model before any process group exists."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    if p.dp_shard == 0:
        raise ConfigError("parallel.dp_shard = 0: expected a positive degree or -1 (the processes left over)")
    fixed = p.pp * p.dp_replicate * p.tp * (p.dp_shard if p.dp_shard > 0 else 1)
    if world_size % fixed:
        raise ConfigError(f"parallel degrees pp × dp_replicate × dp_shard × tp = {p.pp} × {p.dp_replicate} × "
                          f"{p.dp_shard if p.dp_shard > 0 else '-1'} × {p.tp} do not divide the {world_size} processes")
    dp_shard = p.dp_shard if p.dp_shard > 0 else world_size // fixed
    dp = p.dp_replicate * dp_shard
    per_rank = t.global_batch // dp if t.global_batch % dp == 0 else 0
    microbatches = p.pp_microbatches or (per_rank // t.micro_batch if p.pp > 1 else 0)
    layout = Layout(p.dp_replicate, dp_shard, p.tp, p.pp, microbatches)
    if layout.world_size != world_size:
        raise ConfigError(f"parallel degrees pp × dp_replicate × dp_shard × tp = {p.pp} × {p.dp_replicate} × "
                          f"{dp_shard} × {p.tp} = {layout.world_size}, but there are {world_size} processes; the "
                          f"product must equal them")
    if p.pp > 1:
        _check_pipeline(cfg, layout, per_rank)
    for name, value in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads),
                        ("train.seq_len", t.seq_len)):
        if value % p.tp:
            raise ConfigError(f"{name} = {value} must divide by parallel.tp = {p.tp}")
    per_step = t.micro_batch * layout.dp
    if t.global_batch % per_step:
        raise ConfigError(
            f"train.global_batch = {t.global_batch} must divide by train.micro_batch × data-parallel degree = "
            f"{t.micro_batch} × {layout.dp}; choose a global batch that is a multiple of {per_step}")
    if cfg.eval.sequences % layout.dp:
        raise ConfigError(f"eval.sequences = {cfg.eval.sequences} must divide by the data-parallel degree = "
                          f"{layout.dp}")
    return layout


def check_vocab_size(cfg: Config, corpus_vocab: int) -> None:
    """The embedding must have a row for every token id the corpus holds."""
    if cfg.model.vocab_size < corpus_vocab:
        raise ConfigError(f"model.vocab_size = {cfg.model.vocab_size} is smaller than the corpus tokenizer's "
                          f"vocabulary ({corpus_vocab}); set model.vocab_size >= {corpus_vocab}")


def _check_pipeline(cfg: Config, layout: Layout, per_rank: int) -> None:
    p, m = cfg.parallel, cfg.model
    stages = p.pp * p.pp_stages_per_rank
    if m.n_layers % stages:
        raise ConfigError(f"model.n_layers = {m.n_layers} must divide into pp × pp_stages_per_rank = {p.pp} × "
                          f"{p.pp_stages_per_rank} stages")
    interleaved = p.pp_schedule.startswith("interleaved")
    if interleaved and p.pp_stages_per_rank < 2:
        raise ConfigError(f"parallel.pp_schedule = {p.pp_schedule!r} needs parallel.pp_stages_per_rank >= 2, "
                          f"not {p.pp_stages_per_rank}")
    if not interleaved and p.pp_stages_per_rank != 1:
        raise ConfigError(f"parallel.pp_schedule = {p.pp_schedule!r} runs one stage per rank, but "
                          f"parallel.pp_stages_per_rank = {p.pp_stages_per_rank}; use interleaved_1f1b or 1")
    if m.tie_embeddings:
        raise ConfigError("model.tie_embeddings = true cannot be pipelined: the embedding and the output "
                          "projection live in different stages; set parallel.pp = 1 or untie them")
    if per_rank == 0 or layout.pp_microbatches == 0 or per_rank % layout.pp_microbatches:
        raise ConfigError(f"the global batch per data-parallel rank ({cfg.train.global_batch} / {layout.dp}) must "
                          f"split into parallel.pp_microbatches = {layout.pp_microbatches} equal micro-batches")
    if layout.pp_microbatches < p.pp:
        raise ConfigError(f"parallel.pp_microbatches = {layout.pp_microbatches} must be at least parallel.pp = "
                          f"{p.pp} to fill the pipeline")
    val_per_rank = cfg.eval.sequences // layout.dp
    if val_per_rank % layout.pp_microbatches:
        raise ConfigError(f"eval.sequences per data-parallel rank ({val_per_rank}) must divide into "
                          f"parallel.pp_microbatches = {layout.pp_microbatches} micro-batches")


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=VALUE`: VALUE is read as a TOML value when it parses as one, else taken as a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. train.steps=50")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except ValueError:  # not TOML (TOMLDecodeError), or an integer of more digits than Python converts
        value = raw
    return key.strip().split("."), value


def _apply_override(data: dict, keys: list[str], value: Any, text: str) -> None:
    _apply_override_in(data, Config, keys, value, text, "")


def _apply_override_in(data: dict, cls: type, keys: list[str], value: Any, text: str, path: str) -> None:
    node = data
    for i, key in enumerate(keys):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if key not in fields:
            raise _unknown_key(path, key, list(fields))
        tp = typing.get_type_hints(cls)[key]
        last = i == len(keys) - 1
        if last:
            # A string field takes the text as written, even when it reads as a number (989e12).
            node[key] = text.partition("=")[2] if tp is str and isinstance(value, (int, float)) else value
        elif dataclasses.is_dataclass(tp):
            node = node.setdefault(key, {})
            cls, path = tp, f"{path}.{key}" if path else key
        elif (table_tp := _table_type(tp)) is not None and i + 2 < len(keys):
            # data.sources.web.weight=0.5: a named table; from the defaults when the config file has none
            tables = node.setdefault(key, {})
            if not isinstance(tables, dict):
                raise ConfigError(f"override {text!r}: '{'.'.join(keys[:i + 1])}' is a list here, not named tables")
            defaults = dataclasses.asdict(cls())[key]
            if not tables and keys[i + 1] in defaults:
                tables.update(defaults)
            node = tables.setdefault(keys[i + 1], {})
            _apply_override_in(node, table_tp, keys[i + 2:], value, text, f"{path}.{key}.{keys[i + 1]}")
            return
        else:
            raise ConfigError(f"override {text!r}: '{'.'.join(keys[:i + 1])}' is not a section")


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            problem = "is a directory" if path.is_dir() else "does not exist"
            raise ConfigError(f"config file {str(path)!r} {problem}; pass a TOML file such as configs/tiny.toml")
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {e.start}: {e.reason}); TOML files "
                              f"are UTF-8") from None
        except ValueError as e:  # TOMLDecodeError, or an integer of more digits than Python converts
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
        except OSError as e:
            raise ConfigError(f"config file {str(path)!r} cannot be read: {e.strerror or e}") from None
    for text in overrides:
        keys, value = parse_override(text)
        _apply_override(data, keys, value, text)
    cfg = _build(Config, data, "")
    if not cfg.name:
        cfg.name = path.stem if path is not None else "tiny"  # the built-in defaults are configs/tiny.toml
    _check_consistency(cfg)
    return cfg


# ---------------------------------------------------------------- writing and documenting

def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        # JSON string escapes are valid TOML ones; TOML also forbids a raw DEL.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def to_toml(cfg: Config) -> str:
    tree = dataclasses.asdict(cfg)
    lines = [f"name = {_toml_value(tree.pop('name'))}"]
    callbacks = tree.pop("callbacks")

    def write(section: str, values: dict) -> None:  # a nested dataclass is a [section.sub] table
        nested = {k: v for k, v in values.items() if isinstance(v, dict)}
        lines.extend(["", f"[{section}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items() if k not in nested])
        for key, sub in nested.items():
            write(f"{section}.{key}", sub)

    for section, values in tree.items():
        write(section, values)
    for cb in callbacks:
        lines += ["", "[[callbacks]]"] + [f"{k} = {_toml_value(v)}" for k, v in cb.items()]
    return "\n".join(lines) + "\n"


def reference() -> list[tuple[str, str, str, str]]:
    """(key, type, default, help) for every option, for `keel config --reference` and the README."""
    rows = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
                continue
            if typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
                walk(typing.get_args(tp)[0], f"{prefix}{f.name}[].")
                continue
            if (table_tp := _table_type(tp)) is not None:
                walk(table_tp, f"{prefix}{f.name}.NAME.")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            choices = f.metadata.get("choices")
            help_text = f.metadata.get("help", "") + (f"; one of: {', '.join(choices)}" if choices else "")
            type_name = tp.__name__ if isinstance(tp, type) else str(tp)
            rows.append((prefix + f.name, type_name, _toml_value(default), help_text))

    walk(Config, "")
    return rows
