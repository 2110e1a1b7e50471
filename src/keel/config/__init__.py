"""Typed config tree: TOML files, KEY=VALUE overrides, validation with messages that name the field."""

from keel.config.checks import check_vocab_size, ffn_hidden_dim, head_size
from keel.config.load import load_config, parse_override, reference, to_toml
from keel.config.schema import (
    INT_MAX,
    SEED_MAX,
    YEAR_S,
    AlertsConfig,
    CallbackSpec,
    CheckpointConfig,
    CleanConfig,
    Config,
    DataConfig,
    DecontamConfig,
    DedupConfig,
    DrillConfig,
    EvalConfig,
    FaultToleranceConfig,
    GuardConfig,
    HealthConfig,
    MixturePhase,
    ModelConfig,
    MoEConfig,
    MonitorConfig,
    NumericsConfig,
    OptimConfig,
    ParallelConfig,
    SdcConfig,
    SourceConfig,
    SpikeConfig,
    StragglerConfig,
    TrackerQueueConfig,
    TrainConfig,
    WatchdogConfig,
    option,
)

__all__ = [
    "INT_MAX", "SEED_MAX", "YEAR_S", "AlertsConfig", "CallbackSpec", "CheckpointConfig", "CleanConfig", "Config",
    "DataConfig", "DecontamConfig", "DedupConfig", "DrillConfig", "EvalConfig", "FaultToleranceConfig", "GuardConfig",
    "HealthConfig", "MixturePhase", "ModelConfig", "MoEConfig", "MonitorConfig", "NumericsConfig",
    "OptimConfig", "ParallelConfig",
    "SdcConfig", "SourceConfig", "SpikeConfig", "StragglerConfig", "TrackerQueueConfig", "TrainConfig",
    "WatchdogConfig", "option",
    "check_vocab_size", "ffn_hidden_dim", "head_size", "load_config", "parse_override", "reference",
    "to_toml",
]
