"""The run identity compared on resume: which changes are refused, which pass, and what is recorded."""

from __future__ import annotations

import pytest

from keel.checkpoint.identity import (
    IDENTITY,
    check_accept_keys,
    check_identity,
    recorded_identity,
    run_identity,
    setting_changes,
)
from keel.config import Config, MixturePhase, SourceConfig
from keel.errors import ConfigError

TOKENIZER = {"name": "byte", "vocab_size": 259, "bos": 256, "eos": 257, "pad": 258}


def identity_of(cfg: Config, fingerprint: str = "f" * 64) -> dict:
    return run_identity(cfg, fingerprint, TOKENIZER)


def test_every_identity_field_is_in_the_identity() -> None:
    assert set(identity_of(Config())) == set(IDENTITY)


def test_changed_identity_fields_are_refused_with_old_and_new_values() -> None:
    cfg = Config()
    old = identity_of(cfg)
    cfg.model.n_layers, cfg.train.global_batch = 2, 64
    with pytest.raises(ConfigError, match=r"model\.n_layers 4 → 2, train\.global_batch 32 → 64") as e:
        check_identity(old, identity_of(cfg), 100, (), "ckpt/step-000100")
    assert "--accept-change model.n_layers,train.global_batch" in str(e.value) and "\n" not in str(e.value)


def test_an_accepted_change_passes_and_is_returned() -> None:
    cfg = Config()
    old = identity_of(cfg)
    cfg.train.seq_len = 512
    assert check_identity(old, identity_of(cfg), 100, ["train.seq_len"], "c") == {"train.seq_len": (256, 512)}


def test_another_corpus_or_tokenizer_is_a_change_of_identity() -> None:
    old = identity_of(Config())
    assert set(check_identity(old, identity_of(Config(), "0" * 64), 1, ["data.corpus"], "c")) == {"data.corpus"}
    new = run_identity(Config(), "f" * 64, {**TOKENIZER, "name": "bpe:8192", "vocab_size": 8192})
    with pytest.raises(ConfigError, match="data.tokenizer"):
        check_identity(old, new, 1, (), "c")


def test_mixture_phases_may_change_only_after_the_checkpoint_step() -> None:
    cfg = Config()
    cfg.data.sources = {"web": SourceConfig(weight=0.5), "code": SourceConfig(weight=0.5)}
    cfg.data.schedule = [MixturePhase(step=100, weights={"web": 0.2, "code": 0.8})]
    old = identity_of(cfg)
    cfg.data.schedule = [MixturePhase(step=150, weights={"web": 0.1, "code": 0.9})]
    assert check_identity(old, identity_of(cfg), 100, (), "c") == {}  # neither phase has begun at step 100
    with pytest.raises(ConfigError, match="data.schedule"):
        check_identity(old, identity_of(cfg), 120, (), "c")
    cfg.data.sources["web"].weight = 0.7
    with pytest.raises(ConfigError, match="data.mixture"):
        check_identity(old, identity_of(cfg), 50, (), "c")


def test_a_manifest_without_an_identity_is_compared_on_what_it_records() -> None:
    cfg = Config()
    manifest = {"model": {"dim": 256, "n_layers": 4, "init_from": ""}, "seed": 0}
    old = recorded_identity(manifest)
    assert old == {"model.dim": 256, "model.n_layers": 4, "train.seed": 0}
    cfg.train.seq_len = 64  # not recorded by such a manifest: nothing to compare it with
    assert check_identity(old, identity_of(cfg), 10, (), "c") == {}
    cfg.train.seed = 3
    with pytest.raises(ConfigError, match="train.seed 0 → 3"):
        check_identity(old, identity_of(cfg), 10, (), "c")


def test_setting_changes_list_every_changed_key() -> None:
    import dataclasses

    old = dataclasses.asdict(Config())
    cfg = Config()
    cfg.optim.lr, cfg.train.steps = 1e-3, 400
    assert setting_changes(old, cfg) == {"optim.lr": [3e-3, 1e-3], "train.steps": [200, 400]}


def test_accept_change_takes_identity_fields_only() -> None:
    assert check_accept_keys(["train.seq_len", ""]) == ["train.seq_len"]
    with pytest.raises(ConfigError, match="--accept-change optim.lr: not an identity field"):
        check_accept_keys(["optim.lr"])
