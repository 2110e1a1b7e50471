"""Errors a user can cause. The CLI prints their one-line message and exits with code 2."""


class KeelError(Exception):
    """Bad input: config, paths, data or checkpoints. The message is one line naming the problem
    and what would be valid."""


class ConfigError(KeelError):
    pass


class DataError(KeelError):
    pass


class CheckpointError(KeelError):
    pass


EXIT_BAD_INPUT = 2
EXIT_PAUSED = 75
