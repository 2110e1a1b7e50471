"""A degree added to keel as one file (tests/unit/parallel/xp_degree.py, added to the package keel.parallel.dims as
xp.py): its option `parallel.xp` is loaded, checked, written back, compared on resume and documented as keel's
own options are; it enters the world size's product and its messages, the mesh's dimensions after tp, and the
facts it declares (the batch split, the loss divisor, FSDP's mesh: tests/dist/test_new_degree.py builds the
mesh); its check refuses what it cannot run. Context and expert parallelism are declared the same way."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from keel.checkpoint.identity import flat_config, setting_changes
from keel.cli import main
from keel.config import Config, ParallelConfig, load_config, reference, to_toml
from keel.config.sections import Option, sections
from keel.errors import ConfigError
from keel.model.parallelizable import Parallelizable
from keel.parallel.degrees import Degrees, all_degrees, resolve_degrees

BASE = ["model.n_heads=8", "model.n_kv_heads=4", "train.seq_len=256", "train.global_batch=32",
        "train.micro_batch=4", "eval.sequences=64"]
XP_HELP = "exchange-parallel degree: ranks that hold the same sequences, innermost"


def refusal(world: int, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_degrees(load_config(None, [*BASE, *overrides]), world)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_degree_added_as_one_file_is_an_option_loaded_written_compared_and_documented(
        xp: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = load_config(None, ["parallel.xp=2"])
    assert cfg.parallel.xp == 2 and load_config(None).parallel.xp == 1
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    assert re.search(r"\[parallel\]\n(.+\n)*xp = 2\n", path.read_text())
    saved = load_config(path)
    assert saved == cfg and flat_config(saved)["parallel.xp"] == 2
    assert setting_changes(dataclasses.asdict(cfg), load_config(path, ["parallel.xp=4"])) == {"parallel.xp": [2, 4]}
    assert ("parallel.xp", "int", "1", XP_HELP) in reference()
    assert main(["config", "--reference"]) == 0
    assert f"| `parallel.xp` | int | `1` | {XP_HELP} |" in capsys.readouterr().out


@pytest.mark.parametrize(("override", "message"), [
    ("parallel.xp=0", "parallel.xp = 0 is out of range: must be >= 1 and <= 64"),
    ("parallel.xp=two", "parallel.xp = 'two': expected an integer"),
    ("parallel.xpp=2", "unknown config key 'xpp' in [parallel]; did you mean 'xp'?"),
])
def test_a_bad_value_of_an_added_degree_is_one_line(xp: str, override: str, message: str,
                                                    capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert str(info.value) == message
    assert main(["config", override]) == 2
    assert capsys.readouterr().err.splitlines() == [f"keel: error: {message}"]


def test_an_added_degree_enters_the_world_size_and_its_messages(xp: str) -> None:
    degrees = resolve_degrees(load_config(None, [*BASE, "parallel.xp=2"]), 4)
    assert degrees == Degrees(1, 2, 1, registered={"xp": 2}) and degrees.world_size == 4
    assert degrees.dims == ("pp", "dp_replicate", "dp_shard", "cp", "tp", "xp")
    assert degrees.describe() == "dp_shard2 × xp2"
    assert refusal(4, "parallel.xp=3") == ("parallel degrees pp × dp_replicate × dp_shard × tp × xp = 1 × 1 × -1 × "
                                           "1 × 3 do not divide the 4 processes")
    assert refusal(8, "parallel.dp_shard=1", "parallel.cp=2", "parallel.xp=2") == (
        "parallel degrees pp × dp_replicate × dp_shard × cp × tp × xp = 1 × 1 × 1 × 2 × 1 × 2 = 4, but there are 8 "
        "processes; the product must equal them; parallel.dp_shard = 2 would fill them")
    assert refusal(4, "parallel.xp=4", "train.seq_len=254") == "train.seq_len = 254 must divide by parallel.xp = 4"


def test_an_added_degree_has_the_facts_it_declares(xp: str) -> None:
    """xp holds the same sequences (no share of the batch), each of its ranks adds a loss, FSDP does not shard
    over it."""
    degrees = Degrees(1, 2, 2, registered={"xp": 2})
    assert degrees.world_size == 8 and degrees.dp == 2
    assert degrees.product(lambda spec: spec.in_loss) == 8
    assert degrees.product(lambda spec: spec.parameters == "shard") == 2


def test_without_its_file_a_degree_is_an_unknown_key() -> None:
    with pytest.raises(ConfigError, match=r"^unknown config key 'xp' in \[parallel\]; known keys: .*reduce_dtype, "
                                          r"cp, ep$"):
        load_config(None, ["parallel.xp=2"])
    assert [spec.name for spec in all_degrees()] == ["pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"]


def test_context_and_expert_parallelism_are_declared_by_their_own_modules() -> None:
    options = sections(ParallelConfig)
    assert set(options) == {"cp", "ep"} and all(isinstance(o, Option) for o in options.values())
    assert [f.name for f in dataclasses.fields(Config().parallel)][-2:] == ["cp", "ep"]
    hooks = {spec.name: spec.hook for spec in all_degrees() if spec.hook}
    assert hooks == {"cp": "split_context", "ep": "split_experts"}
    assert all(inspect.isfunction(getattr(Parallelizable, hook)) for hook in hooks.values())
