"""What makes a run the run it is, and the check that a resume continues that run and no other.

Identity fields decide what the resumed steps compute and which data they see: the model's shape, the
tokenizer and vocabulary, the sequence length, the global batch, and the data order (seed, corpus,
mixture weights and the mixture phases already begun). Changing one on resume either breaks the load
(a wider model) or, worse, loads and trains on (fewer layers: the first ones load; another batch: another
data order), so such a resume is refused before any worker starts, unless the change is accepted on purpose
with `keel train --accept-change KEY`, which records it as an event and in every later manifest.

Everything else may change on resume and is recorded as a `config/changed` event: the number of steps,
intervals, the optimizer's settings and the tail of its schedule, monitoring, health, guards, the
parallel layout and the micro-batch (the same global batch, split otherwise).

A run that has made all its steps trains nothing more, so a setting changed when it is run again would
apply to nothing while its results stand for the old one: there every setting that shapes what the run
computed is compared too, and only those that say how it is watched, saved, laid out and recovered may
differ (`UNCOMPUTED`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import Any

from keel.config import Config, ModelConfig
from keel.errors import ConfigError

# key → what it stands for (docs/resuming.md's table of identity fields is checked against these keys)
IDENTITY: dict[str, str] = {
    **{f"model.{f.name}": "model shape" for f in dataclasses.fields(ModelConfig)
       if f.name not in ("init_from", "sdpa_backend")},  # the kernel computes the same model
    "train.seq_len": "sequence length", "train.global_batch": "global batch", "train.seed": "initialisation and "
    "data order", "data.tokenizer": "the corpus tokenizer", "data.corpus": "the corpus fingerprint",
    "data.mixture": "source weights", "data.schedule": "mixture phases begun by the checkpoint's step",
    "data.document_mask": "attention within documents", "data.document_positions": "positions per document",
}


def run_identity(cfg: Config, corpus_fingerprint: str, tokenizer: dict) -> dict[str, Any]:
    """The identity of the run `cfg` describes on this corpus, as JSON values."""
    model = dataclasses.asdict(cfg.model)
    values: dict[str, Any] = {f"model.{k}": v for k, v in model.items() if f"model.{k}" in IDENTITY}
    values.update({
        "train.seq_len": cfg.train.seq_len, "train.global_batch": cfg.train.global_batch,
        "train.seed": cfg.train.seed,
        "data.tokenizer": {k: tokenizer.get(k) for k in ("name", "vocab_size", "bos", "eos", "pad", "sha256")},
        "data.corpus": corpus_fingerprint,
        "data.mixture": {name: s.weight for name, s in sorted(cfg.data.sources.items())},
        "data.schedule": [dataclasses.asdict(p) for p in cfg.data.schedule],
        "data.document_mask": cfg.data.document_mask, "data.document_positions": cfg.data.document_positions,
    })
    return json.loads(json.dumps(values))


def recorded_identity(manifest: dict) -> dict[str, Any]:
    """The identity a manifest records; for a checkpoint written before identities were recorded, what can
    be told from its model, seed and tokenizer entries."""
    if "identity" in manifest:
        return manifest["identity"]
    old: dict[str, Any] = {f"model.{k}": v for k, v in (manifest.get("model") or {}).items()
                           if f"model.{k}" in IDENTITY}
    if "seed" in manifest:
        old["train.seed"] = manifest["seed"]
    return old


def _begun(schedule: list, step: int) -> list:
    """The mixture phases that have shaped the steps up to `step` (a phase at step s draws from step s + 1)."""
    return [p for p in schedule if int(p.get("step", 0)) < step]


def identity_changes(old: dict[str, Any], new: dict[str, Any], step: int) -> dict[str, tuple[Any, Any]]:
    """key → (old, new) for each identity field that differs between a checkpoint of `step` and this run."""
    changes = {}
    for key in IDENTITY:
        if key not in old or key not in new:
            continue
        was, now = old[key], new[key]
        if key == "data.schedule":
            was, now = _begun(was, step), _begun(now, step)
        if key == "data.tokenizer":  # compare only what both record
            shared = [k for k in now if k in was]
            was, now = {k: was[k] for k in shared}, {k: now[k] for k in shared}
        if was != now:
            changes[key] = (was, now)
    return changes


def check_identity(old: dict[str, Any], new: dict[str, Any], step: int, accepted: Iterable[str],
                   checkpoint: str) -> dict[str, tuple[Any, Any]]:
    """Refuse a resume that changes an identity field not accepted on purpose; return the accepted changes."""
    accepted = set(accepted)
    changes = identity_changes(old, new, step)
    refused = {k: v for k, v in changes.items() if k not in accepted}
    if refused:
        corpus = " or data.allow_corpus_change=true" if "data.corpus" in refused else ""
        raise ConfigError(f"resuming {checkpoint} would change what defines the run: {_listed(refused)}; start a "
                          f"new run with --run-dir, or accept the change on purpose with --accept-change "
                          f"{','.join(refused)}{corpus} (recorded in events.jsonl and the manifest)")
    return changes


def check_continuation(manifest: dict, cfg: Config, identity: dict[str, Any], accepted: Iterable[str],
                       checkpoint: str) -> dict[str, tuple[Any, Any]]:
    """The check of every start from `manifest`'s checkpoint, in the launcher and in the workers alike: a
    resume may not change the run's identity; a run already finished (its step reached cfg.train.steps, so
    nothing is left to train) may not change any setting it computed with either. Returns the accepted
    changes."""
    step = int(manifest["step"])
    if step < cfg.train.steps:
        return check_identity(recorded_identity(manifest), identity, step, accepted, checkpoint)
    accepted = set(accepted)
    changes: dict[str, tuple[Any, Any]] = identity_changes(recorded_identity(manifest), identity, step)
    changes.update({k: (old, new) for k, (old, new) in setting_changes(manifest.get("config"), cfg).items()
                    if computed(k)})
    refused = {k: v for k, v in changes.items() if k not in accepted}
    if refused:
        steps = "" if any(k in IDENTITY for k in refused) else ", raise train.steps to train on with the new ones"
        corpus = " (or data.allow_corpus_change=true)" if "data.corpus" in refused else ""
        raise ConfigError(f"this run finished at step {step} ({checkpoint}) with other settings: {_listed(refused)}; "
                          f"its results are of those, and it has nothing left to train: start a new run with "
                          f"--run-dir NEW{steps}, or keep its results and record the change with --accept-change "
                          f"{','.join(refused)}{corpus}")
    return changes


# Settings that say how a run is watched, saved, laid out and recovered, not what it computes (the parallel
# layout and the micro-batch give the same steps): a finished run may be run again with them changed.
UNCOMPUTED = ("name", "callbacks", "monitor.", "health.", "checkpoint.", "parallel.", "fault_tolerance.",
              "drill.", "train.micro_batch", "data.prefetch", "data.verify_checksums", "data.allow_corpus_change",
              "eval.interval", "eval.downstream_interval")
# Settings whose effect the identity compares: the corpus's sources, place and preparation are its
# fingerprint (`data.corpus`), the sources' weights its mixture.
COVERED = ("data.sources.", "data.dir", "data.clean.", "data.dedup.", "data.decontam.", "data.val_fraction",
           "data.text_field", "data.shard_tokens", "data.workers")


def computed(key: str) -> bool:
    """Whether the setting `key` shapes what a run computes beyond its identity fields."""
    return key not in IDENTITY and not any(key == p or (p.endswith(".") and key.startswith(p))
                                           for p in UNCOMPUTED + COVERED)


def check_accept_keys(keys: Iterable[str]) -> list[str]:
    keys = [k for k in keys if k]
    known = set(IDENTITY) | {k for k in flat_config(Config()) if computed(k)}
    if unknown := [k for k in keys if k not in known]:
        raise ConfigError(f"--accept-change {','.join(unknown)}: not an identity field ({', '.join(IDENTITY)}) nor "
                          f"a setting a finished run computed with (such as optim.lr or train.steps; "
                          f"docs/resuming.md lists those that may change freely)")
    return keys


def flat_config(cfg: Config | dict) -> dict[str, Any]:
    """Every setting as dotted key → JSON value."""
    tree = dataclasses.asdict(cfg) if isinstance(cfg, Config) else cfg
    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = node

    walk("", json.loads(json.dumps(tree)))
    return out


def setting_changes(old_config: dict | None, cfg: Config) -> dict[str, list]:
    """key → [old, new] for each setting (identity or not) that differs from a checkpoint's config."""
    if not old_config:
        return {}
    old, new = flat_config(old_config), flat_config(cfg)
    return {k: [old.get(k), new.get(k)] for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}


def _listed(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k} {_short(a)} → {_short(b)}" for k, (a, b) in changes.items())


def _short(value: Any) -> str:
    text = json.dumps(value, separators=(",", ":")) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."
