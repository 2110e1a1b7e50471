"""What an unknown flag written the way other trainers take their settings means in keel: torchtitan's
`--training.steps 10` and Hugging Face Trainer's `--learning_rate 3e-4` are keel's `train.steps=10` and
`optim.lr=3e-4`."""

from __future__ import annotations

import difflib

# Another trainer's setting -> keel's config key (torchtitan's dotted sections, then Trainer's arguments).
OTHER_KEYS = {
    "training.steps": "train.steps",
    "training.seq_len": "train.seq_len",
    "training.global_batch_size": "train.global_batch",
    "training.local_batch_size": "train.micro_batch",
    "training.batch_size": "train.micro_batch",
    "training.seed": "train.seed",
    "training.max_norm": "optim.grad_clip",
    "training.data_parallel_shard_degree": "parallel.dp_shard",
    "training.tensor_parallel_degree": "parallel.tp",
    "parallelism.data_parallel_shard_degree": "parallel.dp_shard",
    "parallelism.data_parallel_replicate_degree": "parallel.dp_replicate",
    "parallelism.tensor_parallel_degree": "parallel.tp",
    "parallelism.pipeline_parallel_degree": "parallel.pp",
    "optimizer.lr": "optim.lr",
    "optimizer.eps": "optim.eps",
    "optimizer.weight_decay": "optim.weight_decay",
    "lr_scheduler.warmup_steps": "optim.warmup_steps",
    "checkpoint.keep_latest_k": "checkpoint.keep_last",
    "metrics.log_freq": "monitor.interval",
    "activation_checkpoint.mode": "parallel.activation_checkpoint",
    "learning_rate": "optim.lr",
    "max_steps": "train.steps",
    "per_device_train_batch_size": "train.micro_batch",
    "warmup_steps": "optim.warmup_steps",
    "weight_decay": "optim.weight_decay",
    "adam_beta1": "optim.beta1",
    "adam_beta2": "optim.beta2",
    "adam_epsilon": "optim.eps",
    "max_grad_norm": "optim.grad_clip",
    "lr_scheduler_type": "optim.schedule",
    "seed": "train.seed",
    "logging_steps": "monitor.interval",
    "save_steps": "checkpoint.interval",
    "save_total_limit": "checkpoint.keep_last",
    "eval_steps": "eval.interval",
    "max_seq_length": "train.seq_len",
    "block_size": "train.seq_len",
}
# Another trainer's setting -> the flag of `keel train` that does its job.
OTHER_FLAGS = {
    "job.config_file": "--config",
    "job.dump_folder": "--run-dir",
    "output_dir": "--run-dir",
    "resume_from_checkpoint": "--resume",
    "nproc_per_node": "--nproc",
}


def key_value_hint(command: str, unknown: list[str], argv: list[str]) -> str:
    """For the unknown flags that name a setting: how keel takes them, as one clause; "" when none does."""
    keys, flags = [], []
    for arg in unknown:
        name, _, value = arg.lstrip("-").partition("=")
        name = name.replace("-", "_")
        value = value or _following(arg, argv)
        if command == "train" and name in OTHER_FLAGS:
            flags.append(f"{OTHER_FLAGS[name]} {value}")
        elif key := config_key(name):
            keys.append(f"{key}={value}")
    said = ([f"keel takes settings as KEY=VALUE: {' '.join(keys)}"] if keys else []) + \
        ([f"keel train's own flags: {' '.join(flags)}"] if flags else [])
    return "; ".join(said)


def config_key(name: str) -> str:
    """The config key that a flag's `name` (its dashes as underscores) most likely means, or ""."""
    from keel.config import reference

    keys = [key for key, *_ in reference() if "[" not in key and ".NAME." not in key]
    if name in keys:
        return name
    if name in OTHER_KEYS:
        return OTHER_KEYS[name]
    if "." in name:  # a dotted flag: the nearest key, keel's own or another trainer's
        nearest = difflib.get_close_matches(name, [*keys, *OTHER_KEYS], n=1, cutoff=0.75)
        return OTHER_KEYS.get(nearest[0], nearest[0]) if nearest else ""
    ends = [key for key in keys if key.rpartition(".")[2] == name]  # --seq_len: train.seq_len, when only one
    return ends[0] if len(ends) == 1 else ""


def _following(flag: str, argv: list[str]) -> str:
    """The value given after `flag` on the command line, else VALUE."""
    at = argv.index(flag) + 1 if flag in argv else len(argv)
    return argv[at] if at < len(argv) and not argv[at].startswith("--") and "=" not in argv[at] else "VALUE"
