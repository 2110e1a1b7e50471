"""What a run sets up before its first step and states at start: the attention's kernel."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from keel.config import load_config
from keel.errors import ConfigError
from keel.parallel.degrees import resolve_degrees
from keel.parallel.layout import Layout
from keel.rundir.events import read_jsonl
from keel.train.setup import attention_kernel
from keel.train.trainer import Trainer


def test_a_run_names_its_attention_kernel_in_its_events_at_start(build: Callable[..., Trainer]) -> None:
    trainer = build([], "train.precision=bf16", "data.document_mask=true")
    events = [e for e in read_jsonl(trainer.run_dir / "events.jsonl") if e["kind"] == "attention"]
    assert [e["detail"] for e in events] == [{"backend": "flash", "asked": "auto", "dtype": "bfloat16",
                                              "device": "cpu", "masked": True}]


def test_a_kernel_the_device_lacks_stops_the_run_at_start_in_one_line(build: Callable[..., Trainer]) -> None:
    with pytest.raises(ConfigError, match="model.sdpa_backend = 'cudnn' cannot run the attention here"):
        build([], "model.sdpa_backend=cudnn")


def test_the_kernel_named_is_torchs_pick_for_auto_and_the_one_asked_otherwise(group: None) -> None:
    cfg = load_config(None, [])
    layout = Layout.build("cpu", resolve_degrees(cfg, 1))
    assert attention_kernel(cfg, layout, torch.device("cpu"), torch.float32)["backend"] == "flash"
    cfg = load_config(None, ["model.sdpa_backend=math"])
    assert attention_kernel(cfg, layout, torch.device("cpu"), torch.float32)["backend"] == "math"
