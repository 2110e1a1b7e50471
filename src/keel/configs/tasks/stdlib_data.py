"""The data of keel's shipped tasks, for lm-eval's `custom_dataset` (which imports this file by its path):
`keel.downstream.stdlib_tasks` reads them from the JSON Lines files beside it."""

from keel.downstream.stdlib_tasks import heldout, next_line

__all__ = ["heldout", "next_line"]
