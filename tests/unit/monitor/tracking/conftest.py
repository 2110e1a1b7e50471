"""The trackers' tests train in process with the train tests' Trainer, built as `keel.train.worker` builds it."""

from tests.unit.train.conftest import build  # noqa: F401  (the fixture)
