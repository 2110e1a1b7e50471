"""The run identity compared on resume: which changes are refused, which pass, and what is recorded."""

from __future__ import annotations

import pytest

from keel.checkpoint.identity import (
    IDENTITY,
    UNCOMPUTED,
    check_accept_keys,
    check_continuation,
    check_identity,
    computed,
    flat_config,
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


def test_accept_change_takes_identity_fields_and_computed_settings() -> None:
    assert check_accept_keys(["train.seq_len", "", "optim.lr"]) == ["train.seq_len", "optim.lr"]
    with pytest.raises(ConfigError, match="--accept-change monitor.interval: not an identity field"):
        check_accept_keys(["monitor.interval"])
    with pytest.raises(ConfigError, match="--accept-change optim.learning_rate: not"):
        check_accept_keys(["optim.learning_rate"])


def finished(cfg: Config, step: int = 200) -> dict:
    """The manifest of the checkpoint a run of `cfg` ended with at `step`."""
    import dataclasses

    return {"step": step, "identity": identity_of(cfg), "config": dataclasses.asdict(cfg)}


def test_a_finished_run_refuses_a_setting_it_computed_with_in_one_line() -> None:
    manifest, cfg = finished(Config()), Config()
    cfg.optim.lr, cfg.guard.enabled = 1e-2, False
    with pytest.raises(ConfigError) as e:
        check_continuation(manifest, cfg, identity_of(cfg), (), "runs/tiny/checkpoints/step-000200")
    text = str(e.value)
    assert "finished at step 200" in text and "\n" not in text
    assert "guard.enabled true → false, optim.lr 0.003 → 0.01" in text
    assert "--run-dir NEW" in text and "raise train.steps" in text
    assert "--accept-change guard.enabled,optim.lr" in text


def test_the_same_change_on_a_run_with_steps_left_is_a_resume() -> None:
    cfg = Config()
    cfg.optim.lr = 1e-2
    assert check_continuation(finished(Config(), step=100), cfg, identity_of(cfg), (), "c") == {}
    cfg.train.steps = 400  # raised: the finished run trains on with the new rate
    assert check_continuation(finished(Config()), cfg, identity_of(cfg), (), "c") == {}


def test_a_finished_run_may_change_how_it_is_watched_saved_and_laid_out() -> None:
    cfg = Config()
    cfg.name, cfg.monitor.interval, cfg.monitor.mlflow.enabled = "renamed", 1, True
    cfg.checkpoint.interval, cfg.health.max_restarts, cfg.parallel.dp_shard, cfg.train.micro_batch = 7, 3, 2, 8
    cfg.eval.interval, cfg.data.workers = 5, 4
    assert check_continuation(finished(Config()), cfg, identity_of(cfg), (), "c") == {}


def test_an_identity_change_of_a_finished_run_is_named_once_with_no_way_through_steps() -> None:
    cfg = Config()
    cfg.model.n_layers = 2
    with pytest.raises(ConfigError) as e:
        check_continuation(finished(Config()), cfg, identity_of(cfg), (), "c")
    assert str(e.value).count("model.n_layers") == 2  # the change, and the key to accept
    assert "raise train.steps" not in str(e.value)


def test_an_accepted_change_of_a_finished_run_is_returned_to_be_recorded() -> None:
    cfg = Config()
    cfg.optim.lr, cfg.train.steps = 1e-2, 150
    changes = check_continuation(finished(Config()), cfg, identity_of(cfg), ["optim.lr", "train.steps"], "c")
    assert changes == {"optim.lr": (3e-3, 1e-2), "train.steps": (200, 150)}


def test_which_settings_a_finished_run_compares() -> None:
    keys = set(flat_config(Config()))
    assert {k for k in keys if k.startswith(("optim.", "guard."))} <= {k for k in keys if computed(k)}
    assert {"train.steps", "train.precision", "eval.sequences", "data.skip_batches"} <= {k for k in keys
                                                                                         if computed(k)}
    free = {k for k in keys if not computed(k)}
    assert {k for k in keys if k.startswith(("monitor.", "health.", "checkpoint.", "parallel."))} <= free
    assert set(IDENTITY) & keys <= free  # compared as identity fields, with their own rules, not twice
    assert all(any(k == p or k.startswith(p) for k in keys) for p in UNCOMPUTED), "a prefix matches no setting"


def test_resuming_md_lists_every_setting_a_finished_run_may_change() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "docs" / "resuming.md").read_text()
    section = text[text.index("## A finished run"):]
    for prefix in UNCOMPUTED:
        assert f"`{prefix}*`" in section if prefix.endswith(".") else f"`{prefix}`" in section, prefix
