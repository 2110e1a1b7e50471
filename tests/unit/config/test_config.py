"""Config loading, KEY=VALUE overrides and validation: every error is a one-line ConfigError that names
the field, the offending value and what would be valid."""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from pathlib import Path
from typing import Any

import pytest

from keel.config import (
    CallbackSpec,
    Config,
    MixturePhase,
    SourceConfig,
    load_config,
    reference,
    to_toml,
)
from keel.config.sections import with_sections
from keel.errors import ConfigError
from keel.parallel.degrees import resolve_degrees
from tests.conftest import REPO

CONFIG_FILES = sorted((REPO / "configs").glob("*.toml"))


def config_error(overrides: list[str], path: Path | None = None) -> str:
    """Load expecting a ConfigError; return its message, which must be a single line."""
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert message and "\n" not in message, f"error message must be one line: {message!r}"
    return message


def write(tmp_path: Path, text: str, name: str = "cfg.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---------------------------------------------------------------- config files

def test_config_directory_holds_the_shipped_configs() -> None:
    # Guards the parametrisation below against silently testing nothing.
    assert {"tiny", "small", "llama3_8b", "llama3_70b", "llama3_405b", "deepseek_v3", "qwen3_30b_a3b",
            "mixtral_8x7b"} <= {p.stem for p in CONFIG_FILES}


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.stem)
def test_every_config_file_loads_and_matches_its_toml(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.name == path.stem
    p = cfg.parallel  # on the fewest processes its degrees need
    resolve_degrees(cfg, p.pp * p.dp_replicate * max(p.dp_shard, 1) * p.cp * p.tp)
    # Every value written in the file is the value the config holds (nothing dropped or renamed).
    def holds(node: object, value: object, where: str) -> None:
        if isinstance(value, list) and value and isinstance(value[0], dict):  # an array of tables
            assert isinstance(node, list) and len(node) == len(value), where
            for i, (item, table) in enumerate(zip(node, value, strict=True)):
                holds(item, table, f"{where}[{i}]")
            return
        if not isinstance(value, dict) or isinstance(node, dict) and not node:
            assert node == value, where
            return
        for key, sub in value.items():
            holds(node[key] if isinstance(node, dict) else getattr(node, key), sub, f"{where}.{key}".lstrip("."))

    holds(cfg, tomllib.loads(path.read_text()), "")


def test_name_defaults_to_file_stem_or_default(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "[train]\nsteps = 3\n", "my_run.toml")).name == "my_run"
    assert load_config(None).name == "tiny"
    assert load_config(None) == dataclasses.replace(Config(), name="tiny")


def test_missing_file_and_invalid_toml_are_config_errors(tmp_path: Path) -> None:
    assert "does not exist" in config_error([], tmp_path / "absent.toml")
    assert "is not valid TOML" in config_error([], write(tmp_path, "[train\nsteps = 3\n"))


# ---------------------------------------------------------------- overrides

@pytest.mark.parametrize(("override", "section", "key", "expected", "expected_type"), [
    ("train.steps=50", "train", "steps", 50, int),
    ("optim.lr=3e-4", "optim", "lr", 3e-4, float),
    ("optim.lr=1", "optim", "lr", 1.0, float),  # an integer is accepted where a number is expected
    ("optim.min_lr_ratio=0.05", "optim", "min_lr_ratio", 0.05, float),
    ("train.deterministic=false", "train", "deterministic", False, bool),
    ("model.tie_embeddings=true", "model", "tie_embeddings", True, bool),
    ("data.dir=some/where", "data", "dir", "some/where", str),  # not TOML: taken as a bare string
    ("data.dir=\"quoted dir\"", "data", "dir", "quoted dir", str),
    ("train.device=cpu", "train", "device", "cpu", str),
    (" train.seed =7", "train", "seed", 7, int),  # whitespace around the key is ignored
])
def test_override_values_are_typed(override: str, section: str, key: str, expected: Any,
                                   expected_type: type) -> None:
    value = getattr(getattr(load_config(None, [override]), section), key)
    assert value == expected and type(value) is expected_type


def test_sources_are_named_tables_and_a_list_of_paths_is_one_source() -> None:
    cfg = load_config(None, ["data.sources=['a.py', \"lib/\"]"])
    assert cfg.data.sources == {"main": SourceConfig(paths=["a.py", "lib/"], weight=1.0)}
    cfg = load_config(None, ["data.sources.web.paths=['web/']", "data.sources.web.weight=0.7",
                             "data.sources.code.paths=['code/']", "data.sources.code.weight=0.3",
                             "data.schedule=[{step = 900, weights = {code = 1}}]"])
    assert cfg.data.sources == {"web": SourceConfig(["web/"], 0.7), "code": SourceConfig(["code/"], 0.3)}
    assert cfg.data.schedule == [MixturePhase(step=900, weights={"code": 1})]
    assert load_config(None, ["data.sources.main.weight=2"]).data.sources["main"].paths == ["stdlib"]


@pytest.mark.parametrize(("overrides", "expect"), [
    (["data.schedule=[{step = 5, weights = {web = 1}}]"], "data.schedule[0]: unknown source 'web'"),
    (["data.sources.main.weight=0"], "data.sources: every weight is 0"),
    (["data.schedule=[{step = 5, weights = {main = 1}}, {step = 5, weights = {main = 2}}]"], "must increase"),
    (["data.sources.bad-name.paths=['x']"], "a source name is letters"),
    (["data.tokenizer=sentencepiece"], "expected byte, bpe:VOCAB"),
])
def test_mixture_errors_name_the_problem(overrides: list[str], expect: str) -> None:
    assert expect in config_error(overrides)


def test_top_level_override() -> None:
    assert load_config(None, ["name=\"exp 1\""]).name == "exp 1"


def test_overrides_apply_on_top_of_the_file_in_order() -> None:
    cfg = load_config(REPO / "configs" / "small.toml", ["train.steps=5", "train.steps=7", "optim.lr=1e-3"])
    base = load_config(REPO / "configs" / "small.toml")
    assert cfg.train.steps == 7 and cfg.optim.lr == 1e-3
    assert dataclasses.replace(cfg, train=base.train, optim=base.optim) == base


@pytest.mark.parametrize("override", ["train.steps", "=5", " =5"])
def test_malformed_override(override: str) -> None:
    assert "expected KEY=VALUE" in config_error([override])


# ---------------------------------------------------------------- unknown keys

@pytest.mark.parametrize(("override", "key", "hint"), [
    ("train.step=5", "'step'", "did you mean 'steps'"),
    ("optim.warmup=5", "'warmup'", "did you mean 'warmup_steps'"),
    ("modle.dim=64", "'modle'", "did you mean 'model'"),
])
def test_unknown_key_suggests_the_closest(override: str, key: str, hint: str) -> None:
    message = config_error([override])
    assert f"unknown config key {key}" in message and hint in message


def test_unknown_section_without_close_match_lists_known_keys() -> None:
    message = config_error(["zzz.bar=1"])
    assert "unknown config key 'zzz' in the top level" in message
    assert ("known keys: name, model, data, train, optim, eval, parallel, monitor, checkpoint, guard, health, "
            "fault_tolerance, drill, "
            "callbacks") in message


def test_unknown_keys_in_a_file(tmp_path: Path) -> None:
    message = config_error([], write(tmp_path, "[train]\nstpes = 5\n"))
    assert "unknown config key 'stpes' in [train]" in message and "did you mean 'steps'" in message
    message = config_error([], write(tmp_path, "[optimizer]\nlr = 0.1\n"))
    assert "unknown config key 'optimizer' in the top level" in message and "did you mean 'optim'" in message
    message = config_error([], write(tmp_path, "[[callbacks]]\npath = 'a.b:C'\nargz = {}\n"))
    assert "'argz' in [callbacks[0]]" in message and "did you mean 'args'" in message


def test_override_into_a_leaf_is_rejected() -> None:
    assert "'train.steps' is not a section" in config_error(["train.steps.x=1"])


@pytest.mark.parametrize(("data", "expect"), [
    ("model = 5\n", "model = 5: expected a table"),
    ("callbacks = 5\n", "callbacks = 5: expected an array of tables ([[callbacks]])"),
])
def test_section_of_the_wrong_shape(tmp_path: Path, data: str, expect: str) -> None:
    assert expect in config_error([], write(tmp_path, data))


# ---------------------------------------------------------------- wrong types

@pytest.mark.parametrize(("override", "expect"), [
    ("train.steps=abc", "train.steps = 'abc': expected an integer"),
    ("train.steps=\"abc\"", "train.steps = 'abc': expected an integer"),
    ("train.steps=1.5", "train.steps = 1.5: expected an integer"),
    ("train.steps=true", "train.steps = True: expected an integer"),  # bool is not an int here
    ("optim.lr=fast", "optim.lr = 'fast': expected a number"),
    ("optim.lr=false", "optim.lr = False: expected a number"),
    ("train.deterministic=1", "train.deterministic = 1: expected true or false"),
    ("train.device=1", "train.device = '1': expected one of auto, cpu, cuda"),
    ("data.sources=5", "data.sources = 5: expected named tables, e.g. [data.sources.web]"),
    ("data.sources=[]", "data.sources.main.paths is empty"),
    ("data.sources.main.paths=['ok', 1]", "data.sources.main.paths[1] = 1: expected a string"),
    ("data.sources.web.weight=-1", "data.sources.web.weight = -1.0 is out of range: must be >= 0"),
    ("optim.lr=inf", "optim.lr = inf: expected a finite number"),
    ("optim.lr=nan", "optim.lr = nan: expected a finite number"),
])
def test_wrong_type_names_field_value_and_type(override: str, expect: str) -> None:
    assert expect in config_error([override])


def test_wrong_type_in_a_file(tmp_path: Path) -> None:
    message = config_error([], write(tmp_path, "[[callbacks]]\npath = 'a.b:C'\nargs = 3\n"))
    assert "callbacks[0].args = 3: expected a table" in message


# ---------------------------------------------------------------- ranges and choices

@pytest.mark.parametrize(("override", "expect"), [
    ("train.steps=0", "train.steps = 0 is out of range: must be >= 1"),
    ("train.seed=-1", "train.seed = -1 is out of range: must be >= 0"),
    ("optim.min_lr_ratio=2", "optim.min_lr_ratio = 2.0 is out of range: must be >= 0 and <= 1"),
    ("optim.min_lr_ratio=-0.1", "optim.min_lr_ratio = -0.1 is out of range: must be >= 0 and <= 1"),
    ("optim.lr=0", "optim.lr = 0.0 is out of range: must be > 0"),
    ("data.val_fraction=0.9", "data.val_fraction = 0.9 is out of range: must be > 0 and <= 0.5"),
    ("eval.interval=-1", "eval.interval = -1 is out of range: must be >= 0"),
])
def test_out_of_range_names_the_bound(override: str, expect: str) -> None:
    assert expect in config_error([override])


@pytest.mark.parametrize("override", [
    "optim.min_lr_ratio=0", "optim.min_lr_ratio=1", "data.val_fraction=0.5", "optim.warmup_steps=0",
    "eval.interval=0", "train.seed=0", "optim.grad_clip=0",
])
def test_inclusive_bounds_are_accepted(override: str) -> None:
    keys, value = override.split("=")
    section, key = keys.split(".")
    assert getattr(getattr(load_config(None, [override]), section), key) == float(value)


@pytest.mark.parametrize(("override", "expect"), [
    ("train.device=tpu", "train.device = 'tpu': expected one of auto, cpu, cuda"),
    ("train.precision=fp16", "train.precision = 'fp16': expected one of auto, fp32, bf16"),
    ("optim.schedule=linear", "optim.schedule = 'linear': expected one of cosine, wsd, constant"),
    ("guard.spike.response=panic", "guard.spike.response = 'panic': expected one of rollback, skip, log, off"),
    ("guard.sdc.response=reboot", "guard.sdc.response = 'reboot': expected one of rollback, exit"),
])
def test_choices(override: str, expect: str) -> None:
    assert expect in config_error([override])


# ---------------------------------------------------------------- consistency

@pytest.mark.parametrize(("overrides", "expect"), [
    (["model.dim=100", "model.n_heads=8"], "model.dim = 100 must divide by model.n_heads = 8"),
    (["model.dim=24", "model.n_heads=8", "model.n_kv_heads=4"], "model.dim / model.n_heads = 3 must be even for RoPE"),
    (["model.n_heads=8", "model.n_kv_heads=3"], "model.n_heads = 8 must divide by model.n_kv_heads = 3"),
    (["model.head_dim=7"], "model.head_dim = 7 must be even for RoPE"),
    (["model.rope_scaling=llama3", "model.rope_low_freq_factor=4", "model.rope_high_freq_factor=1"],
     "model.rope_high_freq_factor = 1 must exceed model.rope_low_freq_factor = 4"),
    (["train.seq_len=512", "model.max_seq_len=256"], "train.seq_len = 512 exceeds model.max_seq_len = 256"),
    (["train.global_batch=30", "train.micro_batch=16"],
     "train.global_batch = 30 must divide by train.micro_batch = 16"),
    (["train.global_batch=8", "train.micro_batch=16"],
     "train.global_batch = 8 must divide by train.micro_batch = 16"),
    (["data.skip_batches=[[5, 3]]"], "data.skip_batches[0] = [5, 3]: expected [start, end] with 0 <= start < end"),
    (["data.skip_batches=[[5]]"], "data.skip_batches[0] = [5]: expected [start, end]"),
    (["guard.spike.warmup=80", "guard.spike.window=40"], "guard.spike.warmup = 80 exceeds guard.spike.window = 40"),
])
def test_consistency_checks(overrides: list[str], expect: str) -> None:
    assert expect in config_error(overrides)


def test_consistent_edge_cases_are_accepted() -> None:
    # seq_len == max_seq_len, micro_batch == global_batch, MQA (one KV head), MHA.
    cfg = load_config(None, ["train.seq_len=256", "model.max_seq_len=256", "train.global_batch=16",
                             "model.n_kv_heads=1"])
    assert (cfg.train.seq_len, cfg.train.global_batch, cfg.model.n_kv_heads) == (256, 16, 1)
    assert load_config(None, ["model.n_kv_heads=8"]).model.n_kv_heads == cfg.model.n_heads


def test_callback_path_needs_module_and_class(tmp_path: Path) -> None:
    message = config_error([], write(tmp_path, "[[callbacks]]\npath = 'a.b:C'\n\n[[callbacks]]\npath = 'nocolon'\n"))
    assert "callbacks[1].path = 'nocolon': expected 'package.module:Class'" in message


# ---------------------------------------------------------------- writing and documenting

def roundtrip(cfg: Config, tmp_path: Path) -> Config:
    return load_config(write(tmp_path, to_toml(cfg), "written.toml"))


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.stem)
def test_to_toml_round_trips_config_files(path: Path, tmp_path: Path) -> None:
    cfg = load_config(path)
    assert roundtrip(cfg, tmp_path) == cfg


def test_to_toml_round_trips_every_kind_of_value(tmp_path: Path) -> None:
    cfg = load_config(None, [
        "name='q\"uote \\\\ back\tslash é'", "optim.lr=3e-4", "optim.eps=1e-12", "model.rope_theta=500000.0",
        "model.norm_eps=1e-5", "train.steps=123456789", "train.deterministic=false", "model.tie_embeddings=true",
        "data.sources=['x.py', 'dir with space/', 'ünï']", "data.dir=a/b", "train.device=cpu",
    ])
    cfg.callbacks = [
        CallbackSpec("pkg.mod:A", {"every": 5, "ratio": 0.25, "on": True, "tags": ["a", "b"], "nested": {"k": "v"}}),
        CallbackSpec("pkg.mod:B", {}),
    ]
    back = roundtrip(cfg, tmp_path)
    assert back == cfg
    assert back.digest() == cfg.digest()
    # Equality must see types too: a float written as an int would still compare equal.
    assert type(back.optim.lr) is float and type(back.model.rope_theta) is float


def test_digest_changes_with_the_config() -> None:
    assert load_config(None).digest() == load_config(None).digest()
    assert load_config(None, ["train.steps=5"]).digest() != load_config(None).digest()


def test_to_toml_round_trips_characters_outside_the_bmp(tmp_path: Path) -> None:
    cfg = load_config(None, ["name='run \U0001F680'"])
    assert roundtrip(cfg, tmp_path) == cfg


def _leaf_options(cls: type, prefix: str = "") -> dict[str, Any]:
    """Independent walk of the config tree: every leaf key and its default (a section's registered sections,
    [monitor.NAME], among its own)."""
    leaves: dict[str, Any] = {}
    cls = with_sections(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if dataclasses.is_dataclass(tp):
            leaves |= _leaf_options(tp, f"{prefix}{f.name}.")
        elif item is not None and dataclasses.is_dataclass(item):
            leaves |= _leaf_options(item, f"{prefix}{f.name}[].")
        elif typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
            leaves |= _leaf_options(typing.get_args(tp)[1], f"{prefix}{f.name}.NAME.")
        else:
            leaves[prefix + f.name] = getattr(cls(), f.name)
    return leaves


def test_reference_covers_every_leaf_option() -> None:
    rows = reference()
    keys = [row[0] for row in rows]
    leaves = _leaf_options(Config)
    assert len(keys) == len(set(keys)), "duplicate rows"
    assert set(keys) == set(leaves)
    assert {"train.steps", "optim.lr", "data.sources.NAME.paths", "callbacks[].path", "callbacks[].args"} <= set(keys)
    for key, type_name, default, help_text in rows:
        assert help_text.strip(), f"{key} has no help"
        if leaves[key] is None:  # an option left unset by default: TOML has no null
            assert default == "unset" and "unset" in help_text, key
            continue
        assert type_name.startswith(type(leaves[key]).__name__), (key, type_name)
        # The documented default is valid TOML and is the real default.
        assert tomllib.loads(f"v = {default}")["v"] == leaves[key], key
    # Options restricted to choices document every choice.
    help_by_key = {row[0]: row[3] for row in rows}
    for key, choices in [("train.device", ("auto", "cpu", "cuda")), ("train.precision", ("auto", "fp32", "bf16")),
                         ("optim.schedule", ("cosine", "wsd", "constant")),
                         ("data.tokenizer", ("byte", "bpe:VOCAB", "tokenizer.json"))]:
        assert all(choice in help_by_key[key] for choice in choices), (key, help_by_key[key])


def test_instability_signals_with_compiled_blocks_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["monitor.signals_interval=10", "parallel.compile=true"])
    assert len(str(e.value).splitlines()) == 1 and "parallel.compile = false" in str(e.value)
    assert load_config(None, ["monitor.signals_interval=10"]).monitor.signals_interval == 10


def test_an_attention_logit_threshold_without_the_signals_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="set monitor.signals_interval"):
        load_config(None, ["guard.spike.attn_logit_threshold=100"])
    both = load_config(None, ["guard.spike.attn_logit_threshold=100", "monitor.signals_interval=10"])
    assert both.guard.spike.attn_logit_threshold == 100


def test_an_unset_option_stays_unset_through_the_written_config(tmp_path: Path) -> None:
    unset = load_config(None, [])
    assert unset.monitor.prometheus_port is None and "# prometheus_port: unset" in to_toml(unset)
    assert roundtrip(unset, tmp_path).monitor.prometheus_port is None
    given = load_config(None, ["monitor.prometheus_port=9400"])
    assert roundtrip(given, tmp_path).monitor.prometheus_port == 9400, "a port set is not the unset default"
    with pytest.raises(ConfigError, match="expected an integer"):
        load_config(None, ["monitor.prometheus_port='x'"])


def test_a_compile_mode_without_compile_is_refused_in_one_line() -> None:
    message = config_error(["parallel.compile_mode=max-autotune"])
    assert "parallel.compile = true" in message and "'default'" in message
    assert load_config(None, ["parallel.compile=true", "parallel.compile_mode=reduce-overhead"]
                       ).parallel.compile_mode == "reduce-overhead"
    assert "max-autotune-no-cudagraphs" in config_error(["parallel.compile=true", "parallel.compile_mode=fast"])


def test_op_level_selection_without_selective_checkpointing_is_refused_in_one_line() -> None:
    message = config_error(["parallel.ac_selective=op", "parallel.activation_checkpoint=full"])
    assert "activation_checkpoint = 'selective'" in message
    assert load_config(None, ["parallel.activation_checkpoint=selective", "parallel.ac_selective=op"]
                       ).parallel.ac_selective == "op"
    assert "layer, op" in config_error(["parallel.activation_checkpoint=selective", "parallel.ac_selective=matmul"])


def test_an_sdpa_backend_with_context_parallel_attention_is_refused_in_one_line() -> None:
    message = config_error(["parallel.cp=2", "model.sdpa_backend=flash"])
    assert "model.sdpa_backend = 'auto'" in message and "parallel.cp = 1" in message
    assert "auto, flash, cudnn, efficient, math" in config_error(["model.sdpa_backend=fast"])


def test_bf16_parameters_without_bf16_compute_or_on_several_processes_are_refused_in_one_line() -> None:
    assert "train.precision = 'bf16'" in config_error(["train.param_dtype=bf16"])
    assert "replica_groups = 1" in config_error(["train.param_dtype=bf16", "train.precision=bf16",
                                                 "fault_tolerance.replica_groups=2"])
    cfg = load_config(None, ["train.param_dtype=bf16", "train.precision=fp8"])
    assert resolve_degrees(cfg, 1).world_size == 1
    with pytest.raises(ConfigError, match="with 2 processes FSDP's mixed precision") as e:
        resolve_degrees(cfg, 2)
    assert "\n" not in str(e.value)
