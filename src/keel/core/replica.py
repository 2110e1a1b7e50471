"""Which replica group this process belongs to, as the group launcher tells it (keel.groups)."""

from __future__ import annotations

import os

GROUP_ENV = "KEEL_REPLICA_GROUP"  # this process's replica group (unset: not in a run of replica groups)
ROOT_ENV = "KEEL_REPLICA_ROOT"  # the run directory above the groups' own
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own name for the lighthouse address
PARTICIPANTS = "ft/participants"  # the metric: replica groups in the quorum a step is made by


def replica_group() -> int:
    """This process's replica group (0 outside a run of replica groups)."""
    return int(os.environ.get(GROUP_ENV, "0"))


def in_replica_group() -> bool:
    return GROUP_ENV in os.environ
