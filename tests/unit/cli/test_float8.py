"""train.precision = fp8 is refused, before any process starts, where it cannot run as asked."""

from __future__ import annotations

import pytest
import torch

from keel.cli.train import check_float8
from keel.config import load_config
from keel.errors import ConfigError


def test_float8_is_refused_where_it_cannot_run_as_asked() -> None:
    load_config(None, ["train.precision=fp8", "parallel.tp=2"])  # tensor parallelism takes float8 layers
    cfg = load_config(None, ["train.precision=fp8"])
    with pytest.raises(ConfigError, match="on a GPU needs parallel.compile = true"):
        check_float8(cfg, torch.device("cuda"))
    check_float8(cfg, torch.device("cpu"))  # emulated, eager
    check_float8(load_config(None, ["train.precision=fp8", "parallel.compile=true"]), torch.device("cuda"))
