"""A degree as the one file that adds it to keel would be (`src/keel/parallel/dims/xp.py`): `parallel.xp`, the
innermost dimension of the mesh, whose ranks hold the same sequences, each adding its mean loss to the step's sum,
and which FSDP does not shard over; it refuses a sequence its ranks cannot share. The tests add this file to the
package keel.parallel.dims (tests.package_files.added_module); nothing imports it from here, where it would
register for good."""

from __future__ import annotations

from keel.config import Config, option
from keel.errors import ConfigError
from keel.parallel.degrees import Degrees, degree


def check(cfg: Config, degrees: Degrees) -> None:
    xp = degrees.of("xp")
    if cfg.train.seq_len % xp:
        raise ConfigError(f"train.seq_len = {cfg.train.seq_len} must divide by parallel.xp = {xp}")


XP = degree("xp", option(1, "exchange-parallel degree: ranks that hold the same sequences, innermost", ge=1, le=64),
            after="tp", in_loss=True, check=check)
