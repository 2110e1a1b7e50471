"""Errors a user can cause. The CLI prints their one-line message and exits with code 2."""


class KeelError(Exception):
    """Bad input: config, paths, data or checkpoints. The message is one line naming the problem
    and what would be valid. `every_rank`: every rank of a job raises it alike, so rank 0 alone says it."""

    exit_code = 2

    def __init__(self, message: str, every_rank: bool = False) -> None:
        super().__init__(message)
        self.every_rank = every_rank


class ConfigError(KeelError):
    pass


class DataError(KeelError):
    pass


class CheckpointError(KeelError):
    pass


class StorageError(KeelError):
    """The checkpoint volume refused a save and `checkpoint.on_storage_error = "stop"`."""

    exit_code = 73


EXIT_BAD_INPUT = 2
EXIT_GUARD_STOP = 3  # a guard stopped the run: the trouble needs a person, a restart would meet it again
EXIT_PAUSED = 75
EXIT_QUARANTINE = 76  # a rank was found computing wrong: restart without its node (see quarantine.json)
EXIT_REPLICA_WAIT = 72  # a replica group's quorum or heal outlived every timeout: the agent restarts the worker
EXIT_HANG = 74  # the watchdog found a hang: the agent restarts the workers, which resume from the last checkpoint
EXIT_STORAGE = StorageError.exit_code  # the checkpoint volume refused a save (full, read-only, ...): not restarted
