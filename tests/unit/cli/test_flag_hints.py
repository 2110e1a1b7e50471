"""The `keel` command line, in process: a hint toward KEY=VALUE for the flags of other trainers."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.cli import main


@pytest.mark.parametrize(("argv", "said"), [
    (["train", "--training.steps", "10"], "--training.steps; keel takes settings as KEY=VALUE: train.steps=10"),
    (["train", "--learning_rate", "3e-4"], "--learning_rate; keel takes settings as KEY=VALUE: optim.lr=3e-4"),
    (["config", "--per_device_train_batch_size=4", "--max-steps", "50"],
     "--per_device_train_batch_size=4 --max-steps; keel takes settings as KEY=VALUE: train.micro_batch=4 "
     "train.steps=50"),
    (["train", "--lr_scheduler.warmup_steps", "5", "--weight_decay", "0"],
     "--lr_scheduler.warmup_steps --weight_decay; keel takes settings as KEY=VALUE: optim.warmup_steps=5 "
     "optim.weight_decay=0"),
    (["train", "--seed", "3"], "--seed; keel takes settings as KEY=VALUE: train.seed=3"),
    (["train", "--optim.beta_2", "0.99"], "--optim.beta_2; keel takes settings as KEY=VALUE: optim.beta2=0.99"),
    (["train", "--checkpoint.intervall=20"], "--checkpoint.intervall=20; keel takes settings as KEY=VALUE: "
                                             "checkpoint.interval=20"),
    (["train", "--output_dir", "out", "--seq_len", "64"],
     "--output_dir --seq_len; keel takes settings as KEY=VALUE: train.seq_len=64; keel train's own flags: "
     "--run-dir out"),
])
def test_another_trainers_flag_gets_a_hint_toward_key_value(argv: list[str], said: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [f"keel: error: unrecognized arguments: {said}"]
    assert list(tmp_path.iterdir()) == []


def test_a_flag_that_names_no_setting_gets_no_hint(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--frobnicate", "3", "--output_dir", "x"])  # --output_dir is train's alone: not config's
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        main(["config", "--output_dir", "x"])
    assert capsys.readouterr().err.splitlines() == [
        "keel: error: unrecognized arguments: --frobnicate --output_dir; keel train's own flags: --run-dir x",
        "keel: error: unrecognized arguments: --output_dir (`keel --help` lists the arguments)"]
