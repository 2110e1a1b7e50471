"""The config schema: every section as a dataclass whose fields are declared with `option(default, help, ...)`.

A field's type comes from its annotation and its allowed range from the keywords; the same declarations drive
validation (keel.config.load) and `keel config --reference`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from keel.config.sections import takes_sections, with_sections

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
class MoEConfig:
    experts: int = option(0, "routed experts of each mixture-of-experts block (0: every block has the dense "
                          "feed-forward and nothing below applies)", ge=0)
    top_k: int = option(2, "routed experts each token goes through (at most experts)", ge=1)
    shared_experts: int = option(0, "experts every token goes through besides its routed ones (DeepSeek's shared "
                                 "experts), each of hidden size expert_dim", ge=0)
    expert_dim: int = option(0, "the SwiGLU hidden size of each expert; 0: the dense feed-forward's size (ffn_dim, "
                             "or the rule of ffn_dim_multiplier and multiple_of)", ge=0)
    dense_layers: int = option(0, "the first this many blocks keep the dense feed-forward (DeepSeek-V3: 3); the "
                               "rest are mixture-of-experts blocks", ge=0)
    score: str = option("softmax", "how router logits become expert scores: softmax over the experts (the chosen "
                        "top_k weigh their outputs by their scores, see normalize_top_k) or sigmoid per expert "
                        "(DeepSeek-V3; the chosen scores are normalised to sum to 1)", choices=("softmax", "sigmoid"))
    normalize_top_k: bool = option(False, "score = softmax: normalise the chosen top_k scores to sum to 1 "
                                   "(Qwen3-MoE, Mixtral) instead of keeping their softmax values")
    bias_update_rate: float = option(0.0, "auxiliary-loss-free balancing (DeepSeek-V3: 0.001): a per-expert bias, "
                                     "added to the scores to choose experts only, moves by this much after each "
                                     "optimizer step, up for experts that took fewer tokens than the mean and down "
                                     "for those that took more; 0: off", ge=0)
    aux_loss_coeff: float = option(0.0, "coefficient of DeepSeek-V3's sequence-wise balance loss (the sum over "
                                   "experts of each one's share of the sequence's choices times its mean score, "
                                   "times experts / top_k) added to the training objective; 0: off", ge=0)
    z_loss_coeff: float = option(0.0, "coefficient of the router z-loss (ST-MoE: the mean over tokens of "
                                 "logsumexp(router logits)^2, against growing router logits; ST-MoE: 1e-3); 0: off",
                                 ge=0)
    capacity_factor: float = option(0.0, "0: dropless, every chosen expert computes its tokens; > 0: an expert takes "
                                    "at most ceil(capacity_factor x tokens x top_k / experts) of a micro-batch's "
                                    "tokens, the later ones in the batch are dropped for it (counted)", ge=0)
    score_scale: float = option(1.0, "multiplier of the routed experts' weighted output (DeepSeek's "
                                "routed_scaling_factor: 2.5 in V3)", gt=0)


@dataclass
class ModelConfig:
    dim: int = option(256, "model width", ge=1)
    n_layers: int = option(4, "number of transformer blocks", ge=1)
    n_heads: int = option(8, "attention heads (dim must divide by it)", ge=1)
    n_kv_heads: int = option(4, "key/value heads for grouped-query attention (n_heads must divide by it)", ge=1)
    head_dim: int = option(0, "the size of each attention head, as given (a Hugging Face model's head_dim, e.g. "
                           "Qwen3's 128 at hidden_size 1024 with 16 heads); 0: dim / n_heads", ge=0)
    vocab_size: int = option(259, "embedding rows; at least the tokenizer's vocabulary", ge=1)
    ffn_dim_multiplier: float = option(1.0, "scales the SwiGLU hidden size (Llama rule: 8/3·dim)", gt=0)
    multiple_of: int = option(64, "SwiGLU hidden size is rounded up to a multiple of this", ge=1)
    ffn_dim: int = option(0, "the SwiGLU hidden size as given (a Hugging Face model's intermediate_size), in place "
                          "of the rule of ffn_dim_multiplier and multiple_of; 0: that rule", ge=0)
    norm_eps: float = option(1e-5, "RMSNorm epsilon", gt=0)
    rope_theta: float = option(10000.0, "RoPE base", gt=0)
    rope_scaling: str = option("none", "how RoPE's frequencies are stretched for a context longer than the one the "
                               "model was first trained at: none, or llama3 (Llama 3.1's rule: wavelengths beyond "
                               "rope_original_max_seq_len / rope_low_freq_factor are divided by rope_factor, those "
                               "below rope_original_max_seq_len / rope_high_freq_factor kept, a smooth ramp between)",
                               choices=("none", "llama3"))
    rope_factor: float = option(8.0, "rope_scaling = llama3: the factor the low frequencies are divided by", gt=0)
    rope_low_freq_factor: float = option(1.0, "rope_scaling = llama3: where the ramp begins (see rope_scaling)", gt=0)
    rope_high_freq_factor: float = option(4.0, "rope_scaling = llama3: where the ramp ends (see rope_scaling)", gt=0)
    rope_original_max_seq_len: int = option(8192, "rope_scaling = llama3: the context the model was first trained "
                                            "at", ge=1)
    max_seq_len: int = option(256, "longest sequence the RoPE tables cover", ge=1)
    tie_embeddings: bool = option(False, "share the input embedding with the output projection")
    qk_norm: bool = option(False, "RMSNorm over each head's queries and keys before RoPE (QK-norm: keeps attention "
                           "logits from growing at high learning rates)")
    embedding_norm: str = option("none", "the token embeddings as the first block sees them: as they are, scaled by "
                                 "sqrt(dim), or through an RMSNorm (Takase et al., 'Spike No More')",
                                 choices=("none", "scale", "rmsnorm"))
    parametrization: str = option("sp", "sp (standard) or mup (maximal update, Tensor Programs V): hidden "
                                  "matrices' init std x sqrt(base_dim/dim) and Adam learning rate x base_dim/dim, "
                                  "output logits x base_dim/dim, attention scale sqrt(base head size)/head size; "
                                  "the same model as sp at dim = base_dim", choices=("sp", "mup"))
    base_dim: int = option(0, "mup: the base width the hyper-parameters were tuned at (0: model.dim)", ge=0)
    sdpa_backend: str = option("auto", "the SDPA kernel of the attention: auto (torch's choice, named in the "
                               "run's events at start), flash, cudnn, efficient or math; one the device cannot run "
                               "for the run's shapes and dtype is refused at start (on a CPU: flash or math)",
                               choices=("auto", "flash", "cudnn", "efficient", "math"))
    init_from: str = option("", "start a fresh run from these weights instead of random ones: `hf:PATH`, a "
                            "Hugging Face Llama, Qwen3 or Qwen3-MoE directory (config.json + model.safetensors), "
                            "whose config.json sets the other model.* fields")
    moe: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self) -> None:
        # A checkpoint manifest holds the model as a JSON tree: its [model.moe] table comes back as a dict.
        if isinstance(self.moe, dict):
            self.moe = MoEConfig(**self.moe)


@dataclass
class SourceConfig:
    paths: list[str] = option(["stdlib"], "files, directories and globs (.txt, .py, .md, .jsonl, .jsonl.gz, "
                              ".jsonl.zst, .parquet); fsspec URLs of such files, prefixes or globs (s3://bucket/"
                              "prefix/*.parquet); Hugging Face datasets hf:NAME[:CONFIG][@SPLIT] (a Hub name, a "
                              "save_to_disk directory, a directory of data files or one data file); or 'stdlib' "
                              "(the running interpreter's standard library sources)")
    weight: float = option(1.0, "share of every global batch drawn from this source (weights are normalised)",
                           ge=0)
    min_chars: int = option(0, "this source keeps only its documents of at least this many characters (as "
                            "read: a source of long documents for a context-extension phase); 0: no bound",
                            ge=0)
    max_chars: int = option(0, "this source keeps only its documents of at most this many characters (as read); "
                            "0: no bound", ge=0)


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
    document_mask: bool = option(False, "each token attends only to the earlier tokens of its own document (split "
                                 "at the tokenizer's BOS), not across the documents packed into a sequence")
    document_positions: bool = option(False, "with document_mask: RoPE positions restart at 0 at each document")
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
    precision: str = option("auto", "compute precision (auto: fp32 on CPU, bf16 on CUDA; fp8: bf16 with the blocks' "
                            "linear layers in float8 through torchao, emulated on a CPU: numerics only)",
                            choices=("auto", "fp32", "bf16", "fp8"))
    param_dtype: str = option("fp32", "the dtype the model's parameters and gradients compute in: fp32, or bf16 "
                              "(with precision bf16 or fp8, one process: the forward and backward on bf16 weights, "
                              "bf16 gradients, the update on fp32 master weights that checkpoints hold as with "
                              "fp32)", choices=("fp32", "bf16"))
    float8_recipe: str = option("rowwise", "train.precision = fp8: torchao's scaling recipe, rowwise (a scale per "
                                "row) or tensorwise (one per tensor; with FSDP the all-gather is in float8)",
                                choices=("rowwise", "tensorwise"))
    deterministic: bool = option(True, "deterministic kernels (bitwise-reproducible runs)")
    z_loss: float = option(0.0, "z-loss coefficient: the training objective adds z_loss * mean((log Z)^2), Z the "
                           "softmax's normaliser, against output-logit divergence (PaLM: 1e-4); the loss reported "
                           "stays the cross entropy", ge=0)
    cross_entropy: str = option("torch", "how the loss is computed: torch (F.cross_entropy on an fp32 copy of the "
                                "logits, 14 bytes per bf16 logit at its backward) or fused (keeps the logits and "
                                "one log Z per token and writes the gradient over the logits: 2 bytes per bf16 "
                                "logit; the same loss up to rounding)", choices=("torch", "fused"))

    def compute_precision(self, device_type: str) -> str:
        """bf16 or fp32: what `precision` means on a device of this type (the trainer and the planner); fp8
        computes in bf16 around its float8 matrix multiplications."""
        wide = self.precision in ("bf16", "fp8") or (self.precision == "auto" and device_type == "cuda")
        return "bf16" if wide else "fp32"


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
    independent_weight_decay: bool = option(False, "decay matrices by weight_decay * lr / peak lr per step instead "
                                            "of weight_decay * lr, so that the decay does not change with the peak "
                                            "learning rate (Wortsman et al. 2024; values around 1e-4)")
    grad_clip: float = option(1.0, "global gradient-norm clipping threshold (0 disables)", ge=0)


@dataclass
class EvalConfig:
    interval: int = option(50, "steps between validation passes (0: only the final one)", ge=0)
    final: bool = option(True, "also a validation pass at the last step, whatever the interval (the summary's "
                         "val_loss is the last pass's; NaN when there was none)")
    sequences: int = option(64, "validation sequences per pass, shared out over the processes (the same set "
                            "whatever the layout)", ge=1)
    downstream_tasks: list[str] = option([], "lm-evaluation-harness tasks run on the model during training "
                                         "(needs the eval extra), e.g. [\"hellaswag\", \"arc_easy\"] or tasks "
                                         "of downstream_include; logged as eval/TASK/METRIC")
    downstream_include: list[str] = option([], "directories of lm-eval task YAML files, for downstream_tasks")
    downstream_interval: int = option(0, "steps between downstream evaluations (0: only at the last step)", ge=0)
    downstream_limit: int = option(0, "at most this many examples per downstream task (0: all)", ge=0)
    downstream_batch: int = option(8, "sequences per forward pass of a downstream evaluation", ge=1)


# The degrees of the layout beyond pp, dp_replicate, dp_shard and tp (parallel.cp, parallel.ep, ...) are
# declared each by its own module of keel.parallel.dims (`keel.parallel.degrees.degree`), so that a degree is
# added by its file alone.
@takes_sections("keel.parallel.dims", "degree")
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
    ac_selective: str = option("layer", "what activation_checkpoint = selective recomputes: layer (one whole block in "
                               "ac_every) or op (every block, keeping the outputs of its attention and of every "
                               "other matrix multiplication and recomputing the rest: less memory than none, less "
                               "recomputation than full; ac_every does not apply)", choices=("layer", "op"))
    compile: bool = option(False, "torch.compile each transformer block")
    compile_mode: str = option("default", "parallel.compile = true: torch.compile's mode for each block: default, "
                               "reduce-overhead (CUDA graphs: fewer kernel launches, more memory), max-autotune "
                               "(benchmarks kernel choices while compiling, and CUDA graphs) or "
                               "max-autotune-no-cudagraphs", choices=("default", "reduce-overhead", "max-autotune",
                                                                      "max-autotune-no-cudagraphs"))
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
    attention_logit: float = option(1000.0, "alert when the largest attention logit (monitor.signals_interval) "
                                    "exceeds this: attention saturates as logits grow into the thousands", gt=0)
    gpu_temp_c: float = option(87.0, "alert when a GPU is hotter than this (°C)", gt=0)
    goodput_target: float = option(0.8, "alert when the run's goodput ratio is below this ...", ge=0, le=1)
    goodput_after_s: float = option(1800.0, "... once the run is older than this many seconds of wall time", ge=0,
                                    le=YEAR_S)
    moe_collapse_share: float = option(0.1, "mixture of experts: alert (moe_collapse) when an expert's share of its "
                                       "layer's tokens over a logged interval is below this fraction of the fair "
                                       "share (1 / experts), below 1 ...", gt=0)
    moe_collapse_intervals: int = option(3, "... for this many logged intervals in a row", ge=1)
    moe_imbalance_max: float = option(4.0, "mixture of experts: alert (moe_imbalance) when a layer's busiest expert "
                                      "takes more than this many times the fair share of a logged interval's tokens "
                                      "(max / mean load; at most experts / top_k)", gt=1)


@dataclass
class TrackerQueueConfig:
    queue: int = option(10000, "records held for a slow or unreachable tracker; beyond this they are dropped and "
                        "counted, training never waits", ge=1)
    close_timeout_s: float = option(30.0, "at the end, seconds the trackers get to send what they hold", ge=0,
                                    le=3600)


# Each experiment tracker's section, [monitor.NAME], is declared by the tracker's own module of
# keel.monitor.tracking (`@tracker(NAME, config=...)`), so that a tracker is added by its file alone.
@takes_sections("keel.monitor.tracking", "tracker section")
@dataclass
class MonitorConfig:
    interval: int = option(10, "steps between metric reductions across ranks: metrics.jsonl records, progress "
                           "lines, the exporter, TensorBoard and the alert rules over metrics", ge=1)
    peak_flops: str = option("auto", "peak FLOP/s per device for MFU: auto (the accelerator catalog; measured on a "
                             "CPU; unknown devices report MFU as unknown), measure (a matmul probe at start), or "
                             "a number such as 989e12")
    profile_interval: int = option(0, "profile one step in this many to measure time in collectives "
                                   "(0, the default: never; a profiled step takes 1-3 s longer)", ge=0)
    signals_interval: int = option(0, "compute the instability signals on one step in this many (0, the default: "
                                   "never): per layer the largest attention logit and the RMS of the activations and "
                                   "of the update, and the output logits' log-normaliser; that step runs extra "
                                   "matmuls and two reductions", ge=0)
    telemetry_interval_s: float = option(10.0, "seconds between hardware, network and storage samples of each "
                                         "node (0: no telemetry)", ge=0, le=YEAR_S)
    prometheus_port: int | None = option(None, "port of the Prometheus exporter; unset: 9400, or the next free port "
                                         "when it is taken; a port set here is served or the start is refused; 0: "
                                         "no exporter. With per = rank, rank r of a node serves port + r",
                                         ge=0, le=65535)
    prometheus_host: str = option("127.0.0.1", "address the exporter binds (0.0.0.0 to let other hosts scrape)")
    prometheus_per: str = option("node", "node: one exporter per node (local rank 0: the run's metrics, its own "
                                 "rank's, the node's telemetry); rank: one per process", choices=("node", "rank"))
    tensorboard: bool = option(False, "also write TensorBoard event files to RUN_DIR/tensorboard (needs the "
                               "tensorboard extra)")
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    trackers: TrackerQueueConfig = field(default_factory=TrackerQueueConfig)


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
    memory_interval: int = option(0, "steps between checkpoints held in host memory (the node's shared memory, "
                                  "kept by the launcher across worker restarts): workers restarted after a failure "
                                  "restore the newest checkpoint of either tier, one in memory without reading "
                                  "storage; 0: off", ge=0)
    memory_dir: str = option("", "where the memory tier lives on each node (default: a directory in /dev/shm named "
                             "after the run directory); a RAM filesystem its processes share")


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
    attn_logit_threshold: float = option(0.0, "a sampled step (monitor.signals_interval) whose largest attention "
                                         "logit is above this is a spike too, seen after its update (so skip acts "
                                         "as rollback); 0: not checked", ge=0)


@dataclass
class SdcConfig:
    fingerprint_interval: int = option(50, "steps between comparisons of replicas' parameter and optimizer "
                                       "fingerprints (HSDP replicas; also before every checkpoint); 0: only "
                                       "before checkpoints", ge=0)
    replay_interval: int = option(200, "steps between step replays (forward/backward recomputed and compared "
                                  "bitwise; also whenever the numerics or spike guards fire): each costs one more "
                                  "forward and backward; 0: only then", ge=0)
    update_replay: bool = option(True, "on a replayed step whose gradients replay the same, also re-execute its "
                                 "optimizer update into scratch memory and compare it bitwise with the update made")
    at_rest_interval: int = option(1, "steps between checks of the state at rest: each rank seals a checksum of "
                                   "its own shards of parameters and optimizer state after the update and verifies "
                                   "it before the next one (also after every restore and rollback); 1 watches every "
                                   "step, N only every N-th step's (the update rewrites the state: no step is "
                                   "checked later); 0: off", ge=0)
    at_rest_moments_every: int = option(1, "the optimizer state is checked at rest in this many turns, the "
                                        "parameters at every check: N > 1 lowers the check's cost (down to a third "
                                        "with Adam) but catches a corruption of the optimizer state only when it "
                                        "falls in its tensor's turn (one check in N); 1: all of it every time", ge=1)
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
    link_probe_mib: int = option(4, "jobs of 3 nodes or more: on each gather the nodes' first ranks pass a probe "
                                 "of this many MiB round a ring; a node whose links both ways take `factor` times "
                                 "the median node's is reported too (0: off)", ge=0, le=1024)
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
    cut_off_limit: int = option(3, "elastic jobs: a node cut off from the rendezvous rejoins once it answers "
                                "again, until its Nth time in one command: then it is listed in quarantine.json",
                                ge=1)
    flap_limit: int = option(3, "elastic jobs: a node whose job links flap (carrier lost, then back) this many "
                             "times in one command lists itself in quarantine.json and leaves (0: never)", ge=0)
    in_process_restart: bool = option(False, "one-node CPU jobs: a worker killed by a signal (SIGKILL, the OOM "
                                      "killer, a crash) is restarted alone, using one of the restarts; the others "
                                      "keep their processes, re-form the process group with it and restore the "
                                      "newest checkpoint (the memory tier's where there is one) in place. Jobs of "
                                      "several nodes, of replica groups or on CUDA restart every worker, and say "
                                      "so")
    shutdown_grace_s: int = option(120, "seconds the launcher gives the workers to checkpoint after SIGTERM, before "
                                   "SIGKILL", ge=1, le=YEAR_S)
    preflight: str = option("warn", "checks before the first step and after every restart: warn (report and go "
                            "on), fail (end the run naming the node and rank: exit 2 for the checkpoint storage, "
                            "76 with the node quarantined for a node's own fault) or off",
                            choices=("warn", "fail", "off"))
    preflight_probe_mib: int = option(64, "largest size of the storage and all-reduce probes (MiB; smaller when "
                                      "a checkpoint or the model's fp32 gradients are)", ge=1)
    min_host_memory_gib: float = option(1.0, "preflight: host memory that must be available (GiB)", ge=0)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)


@dataclass
class FaultToleranceConfig:
    replica_groups: int = option(1, "replica groups (torchft): each a full copy of the model in its own torchrun "
                                 "job; a failed group heals from a live one while the others keep training "
                                 "(1: off; `keel train --replica-groups` overrides)", ge=1, le=1024)
    min_replicas: int = option(1, "live replica groups a step needs to commit; with fewer the groups wait",
                               ge=1, le=1024)
    lighthouse: str = option("", "address of a running torchft lighthouse, http://HOST:PORT (empty: `keel train` "
                             "starts one on loopback)")
    heartbeat_timeout_s: float = option(1.0, "a replica group whose heartbeat is older than this is dead: the "
                                        "next quorum goes on without it (the survivors' longest stall)", gt=0,
                                        le=YEAR_S)
    join_timeout_s: float = option(60.0, "how long a quorum waits for a group that heartbeats but has not "
                                   "joined yet", gt=0, le=YEAR_S)
    quorum_timeout_s: float = option(120.0, "how long a step waits for its quorum (and a heal for its state)",
                                     gt=0, le=YEAR_S)
    timeout_s: float = option(60.0, "timeout of the cross-group all-reduce, commit vote and state transfer",
                              gt=0, le=YEAR_S)
    max_restarts: int = option(10, "restarts each replica group's own agent may make", ge=0)
    transport: str = option("http", "how a healing group receives a live group's state: http (torchft's HTTP "
                            "server on each group) or pg (over the groups' process group)", choices=("http", "pg"))


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
    parallel: ParallelConfig = field(default_factory=lambda: with_sections(ParallelConfig)())
    monitor: MonitorConfig = field(default_factory=lambda: with_sections(MonitorConfig)())
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    drill: DrillConfig = field(default_factory=DrillConfig)
    callbacks: list[CallbackSpec] = field(default_factory=list)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]
