"""Watching a mixture-of-experts router in real training runs in this process (tiny_moe's routing on the small
test model): the metrics of each logged interval, their Prometheus series, the routing-collapse alert, and the
guards (a non-finite step skipped, a spike rolled back, every step replayed) on an expert model unchanged."""

from __future__ import annotations

import math
import shutil
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from keel.checkpoint.inspect import state_sha256
from keel.config import CallbackSpec
from keel.core.callbacks import Build, Callback, Step
from keel.core.net import free_port
from keel.model.moe import MoE
from keel.rundir.events import read_jsonl
from keel.train.experts import ExpertBalance
from keel.train.trainer import Trainer
from keel.train.worker import ENDED
from tests.conftest import REPO
from tests.unit.train.test_trainer import SYNCHRONISING, CountsHostSyncs

HERE = "tests.unit.train.test_expert_watch"
TINY_MOE = tomllib.loads((REPO / "configs" / "tiny_moe.toml").read_text())["model"]["moe"]
# tiny_moe's routing (8 experts, 2 chosen by sigmoid scores, its balancing rate) in three blocks of the small test
# model, the first dense: expert layers 1 and 2, each expert a quarter of the small model's feed-forward.
SHRUNK = [*(f"model.moe.{key}={value!r}".replace("'", '"') for key, value in TINY_MOE.items()), "model.n_layers=3",
          "model.moe.expert_dim=64"]
LAYERS, EXPERTS, TOP_K = (1, 2), TINY_MOE["experts"], TINY_MOE["top_k"]
TOKENS = 8 * 64  # a step's tokens: SMALL_RUN's global batch × sequence length
# At a small learning rate the router stays near its start, which spreads the tokens over every expert.
CALM = ["optim.lr=1e-4"]


class Biases(Callback):
    """What the expert layers' selection biases were (all layers in one vector) at each step hook: (hook, step
    number, state.step, biases)."""

    def __init__(self) -> None:
        self.layers: list[MoE] = []
        self.seen: list[tuple[str, int, int, torch.Tensor]] = []

    def on_build(self, build: Build) -> None:
        self.layers = [m for part in build.parts for m in part.modules() if isinstance(m, MoE)]

    def _see(self, hook: str, step: Step) -> None:
        self.seen.append((hook, step.number, step.state.step, torch.cat([m.expert_bias for m in self.layers]).clone()))

    def on_step_start(self, step: Step) -> None:
        self._see("on_step_start", step)

    def on_step_end(self, step: Step) -> None:
        self._see("on_step_end", step)

    def at(self, hook: str, number: int) -> list[torch.Tensor]:
        return [biases for h, n, _, biases in self.seen if h == hook and n == number]


class StarveExpert(Callback):
    """Plants a routing collapse: expert `expert` of every expert layer gets a selection bias so low that no token
    ever chooses it."""

    def __init__(self, expert: int = 0) -> None:
        self.expert = expert

    def on_build(self, build: Build) -> None:
        for part in build.parts:
            for module in part.modules():
                if isinstance(module, MoE):
                    module.expert_bias[self.expert] = -1e4


def spec(name: str, **args: object) -> CallbackSpec:
    return CallbackSpec(path=f"{HERE}:{name}", args=args)


@pytest.fixture
def fit(build: Callable[..., Trainer]) -> Callable[..., tuple[int, Trainer]]:
    """Builds the shrunk tiny_moe with `callbacks` and `overrides` and fits it: (exit code, trainer)."""
    def run(callbacks: list[CallbackSpec], *overrides: str) -> tuple[int, Trainer]:
        trainer = build(callbacks, *SHRUNK, *overrides)
        code = trainer.fit()
        trainer.monitor.close(ENDED.get(code, "failed"))
        return code, trainer

    return run


def set_aside(trainer: Trainer, where: Path) -> Path:
    """Move a finished run's directory out of the way of the next run the test builds."""
    shutil.move(trainer.run_dir, where)
    return where


def events(run: Trainer | Path, kind: str) -> list[dict]:
    run_dir = run.run_dir if isinstance(run, Trainer) else run
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == kind]


def moe_metrics(run: Trainer | Path) -> dict[int, dict]:
    """The expert metrics of each logged step."""
    run_dir = run.run_dir if isinstance(run, Trainer) else run
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("moe/")}
            for r in read_jsonl(run_dir / "metrics.jsonl") if "moe/imbalance_max" in r}


# ---------------------------------------------------------------- metrics


def test_each_logged_interval_holds_every_expert_layers_loads_entropy_and_bias_spread(fit) -> None:
    code, trainer = fit([spec("Biases")], "monitor.interval=2")
    (balance,) = trainer.hooks.of_type(ExpertBalance)
    (biases,) = trainer.hooks.of_type(Biases)
    logged = moe_metrics(trainer)
    assert code == 0 and sorted(logged) == [2, 4, 6]
    for step, record in logged.items():
        for layer in LAYERS:
            shares = record[f"moe/load/layer_{layer}"]
            assert len(shares) == EXPERTS and math.isclose(sum(shares), 1.0, abs_tol=1e-5)
            # The interval's two steps: every token of each chose top_k experts, counted once.
            counts = [share * 2 * TOKENS * TOP_K for share in shares]
            assert all(abs(c - round(c)) < 0.01 for c in counts), counts
            assert record[f"moe/imbalance/layer_{layer}"] == pytest.approx(max(shares) * EXPERTS, abs=1e-4)
            assert record[f"moe/min_load/layer_{layer}"] == pytest.approx(min(shares) * EXPERTS, abs=1e-4)
            assert 0 < record[f"moe/entropy/layer_{layer}"] <= math.log(EXPERTS)
            assert f"moe/dropped_tokens/layer_{layer}" not in record, "dropless: nothing to count"
            # The biases moved by the step that ends the interval, as the model holds them then.
            [held] = biases.at("on_step_end", step)
            layer_biases = held[(layer - 1) * EXPERTS:layer * EXPERTS]
            assert record[f"moe/bias_spread/layer_{layer}"] == pytest.approx(
                float(layer_biases.max() - layer_biases.min()), abs=1e-7)
        assert record["moe/imbalance_max"] == max(record[f"moe/imbalance/layer_{i}"] for i in LAYERS)
    assert logged[6]["moe/bias_spread/layer_1"] > 0, "tiny_moe's balancing moved the biases"
    assert torch.equal(balance.biases[1:], torch.stack([m.expert_bias for m in biases.layers]))


def test_a_capacity_counts_the_dropped_tokens_of_each_interval_over_every_rank(fit) -> None:
    code, trainer = fit([], "model.moe.capacity_factor=1.0", "train.steps=3")
    logged = moe_metrics(trainer)
    assert code == 0 and sorted(logged) == [1, 2, 3]
    for record in logged.values():
        for layer in LAYERS:
            shares, dropped = record[f"moe/load/layer_{layer}"], record[f"moe/dropped_tokens/layer_{layer}"]
            # Each forward of a micro-batch (4 sequences of 64 tokens) keeps at most ceil(4 · 64 · 2 / 8) = 64 slots
            # per expert: two micro-batches a step.
            over = sum(max(0.0, share * TOKENS * TOP_K - 2 * 64) for share in shares)
            assert dropped == float(round(dropped)) and over <= dropped + 0.01, (dropped, over)


def test_a_steady_state_expert_step_reads_one_value_on_the_host(fit, monkeypatch: pytest.MonkeyPatch) -> None:
    """The counts, their all-reduce and the biases' update stay on the device between logged steps."""
    for name in SYNCHRONISING:  # put back after the test whatever the counter wraps
        monkeypatch.setattr(torch.Tensor, name, getattr(torch.Tensor, name))
    count = CallbackSpec(path=f"{CountsHostSyncs.__module__}:CountsHostSyncs", args={"first": 2, "steps": 3})
    code, trainer = fit([count], "monitor.interval=100", "checkpoint.interval=100", "monitor.profile_interval=0")
    (counter,) = trainer.hooks.of_type(CountsHostSyncs)
    assert code == 0 and counter.calls["tolist in StepSync.reduce"] == 3
    # On a CPU the experts' compute loops over the experts, reading its group sizes (a GPU's grouped GEMM does not):
    # the counting, its sums over the ranks and the biases' update read nothing.
    watch = ("ExpertBalance.", "counters", "score_entropy", "bias_step", "MoE.routed", "MoE.forward")
    assert not [call for call in counter.calls if call.split(" in ")[1].startswith(watch)], counter.calls


def test_the_expert_metrics_reach_prometheus_with_layer_and_expert_labels(fit, tmp_path) -> None:
    code, trainer = fit([], "train.steps=3", f"monitor.prometheus_port={free_port()}")
    assert code == 0 and trainer.monitor.exporter is not None
    port = trainer.monitor.exporter.port
    from tests.unit.monitor.test_monitor import scrape

    families = scrape(port)
    loads = {(s[1]["layer"], s[1]["expert"]): s[2] for s in families["keel_moe_load"]}
    assert sorted(loads) == [(str(layer), str(e)) for layer in LAYERS for e in range(EXPERTS)]
    last = moe_metrics(trainer)[3]
    assert all(loads[(str(layer), str(e))] == last[f"moe/load/layer_{layer}"][e] for layer, e in
               [(layer, e) for layer in LAYERS for e in range(EXPERTS)])
    for family in ("keel_moe_imbalance", "keel_moe_min_load", "keel_moe_entropy", "keel_moe_bias_spread"):
        assert sorted(s[1]["layer"] for s in families[family]) == ["1", "2"], family
    assert families["keel_moe_imbalance_max"][0][2] == last["moe/imbalance_max"]
    run_label = families["keel_moe_load"][0][1]["run"]

    if shutil.which("prometheus") is None:
        return
    from tests.dist.test_monitoring import Prometheus

    server = Prometheus(tmp_path, port)
    try:
        series = server.wait_for(lambda: server.query("sum by (layer) (keel_moe_load)"), 60, "the expert loads")
        assert sorted(s["metric"]["layer"] for s in series) == ["1", "2"]
        assert all(float(s["value"][1]) == pytest.approx(1.0, abs=1e-5) for s in series), series
        starved = server.query(f'min by (layer) (keel_moe_load{{run="{run_label}"}}) * 8')
        assert {s["metric"]["layer"]: float(s["value"][1]) for s in starved} == pytest.approx(
            {str(layer): last[f"moe/min_load/layer_{layer}"] for layer in LAYERS}, abs=1e-4)
    finally:
        server.close()


# ---------------------------------------------------------------- alerts


def test_a_planted_routing_collapse_raises_an_alert_naming_layer_and_expert(fit) -> None:
    code, trainer = fit([spec("StarveExpert", expert=0)], *CALM, "model.moe.bias_update_rate=0", "train.steps=4",
                        "monitor.alerts.moe_imbalance_max=1.2")
    assert code == 0
    assert all(record[f"moe/load/layer_{layer}"][0] == 0.0 for record in moe_metrics(trainer).values()
               for layer in LAYERS)
    alerts = {e["action"]: e for e in events(trainer, "alert")}
    collapse = alerts["moe_collapse"]
    assert collapse["step"] == 3, "the third logged interval in a row below a tenth of the fair load"
    assert collapse["detail"]["experts"] == [{"layer": 1, "expert": 0, "of_fair": 0.0},
                                             {"layer": 2, "expert": 0, "of_fair": 0.0}]
    assert "layer 1 expert 0 at 0%" in collapse["detail"]["message"]
    assert collapse["detail"]["severity"] == "error"
    imbalance = alerts["moe_imbalance"]
    assert imbalance["step"] == 1 and {e["layer"] for e in imbalance["detail"]["experts"]} == set(LAYERS)


def test_a_balanced_run_raises_no_routing_alert(fit) -> None:
    code, trainer = fit([], *CALM, "train.steps=8", "monitor.interval=2")
    logged = moe_metrics(trainer)
    assert code == 0 and len(logged) == 4
    # Balanced indeed: no expert ever fell under a tenth of its fair load, none took four times it.
    assert min(r[f"moe/min_load/layer_{layer}"] for r in logged.values() for layer in LAYERS) > 0.1
    assert max(r["moe/imbalance_max"] for r in logged.values()) < 4.0
    assert not [e for e in events(trainer, "alert") if e["action"].startswith("moe_")]


# ---------------------------------------------------------------- the guards on an expert model


def test_a_non_finite_step_is_skipped_with_its_expert_counts(fit, tmp_path: Path) -> None:
    nan = CallbackSpec(path="keel.drill.faults:NanInGradients", args={"step": 3, "rank": 0})
    code, trainer = fit([nan, spec("Biases")], "train.steps=5")
    (biases,) = trainer.hooks.of_type(Biases)
    assert code == 0 and [e["action"] for e in events(trainer, "guard")] == ["skip"]
    # The skipped step's loads moved no bias, and the next step's moved them from where they were.
    [before], [skipped], [after] = (biases.at("on_step_end", n) for n in (2, 3, 4))
    assert torch.equal(skipped, before) and not torch.equal(after, skipped)
    faulted = set_aside(trainer, tmp_path / "nan")
    assert sorted(moe_metrics(faulted)) == [1, 2, 4, 5], "an interval without an applied step has no loads to log"

    code, told = fit([spec("Biases"), CallbackSpec(path="keel.drill.faults:SkipUpdateAt", args={"step": 3})],
                     "train.steps=5")
    (told_biases,) = told.hooks.of_type(Biases)
    assert code == 0 and torch.equal(told_biases.at("on_step_end", 5)[0], biases.at("on_step_end", 5)[0])
    assert moe_metrics(told) == moe_metrics(faulted), "the same run as one told to skip that step"


def test_a_spike_rolls_back_and_the_biases_come_back_with_the_weights(fit) -> None:
    poison = CallbackSpec(path="keel.drill.faults:PoisonedBatch", args={"batch": 18})  # read by step 19
    code, trainer = fit([spec("Biases"), poison], "train.steps=24", "guard.spike.warmup=8", "guard.spike.window=16",
                        "guard.spike.loss_threshold=3", "guard.snapshot_interval=10", "guard.rollback_steps=5",
                        "checkpoint.interval=100")
    (biases,) = trainer.hooks.of_type(Biases)
    (balance,) = trainer.hooks.of_type(ExpertBalance)
    assert code == 0
    [rolled] = [e for e in events(trainer, "guard") if e["action"] == "rolled_back"]
    assert rolled["detail"]["to_step"] == 10
    [snapshot] = biases.at("on_step_end", 10)
    first, again = biases.at("on_step_start", 11)
    assert not torch.equal(biases.at("on_step_end", 18)[0], snapshot), "the biases had moved on"
    assert torch.equal(first, snapshot) and torch.equal(again, snapshot), "back with the weights of step 10"
    assert torch.equal(balance.biases[1:].flatten(), torch.cat([m.expert_bias for m in biases.layers]))


def test_every_step_replayed_changes_nothing_an_expert_model_computes(fit, tmp_path: Path) -> None:
    """A replay recomputes the step's forward, which counts its tokens again: the step's own counts are put back,
    so the biases, the loads, the dropped tokens and the weights are those of a run without replays."""
    capacity = "model.moe.capacity_factor=1.0"
    code, trainer = fit([], capacity, "guard.sdc.replay_interval=1", "train.steps=4")
    assert code == 0 and not events(trainer, "guard")
    assert trainer.guards.counts["sdc_replays"] == 4
    replayed = set_aside(trainer, tmp_path / "replayed")
    code, plain = fit([], capacity, "train.steps=4")
    assert code == 0 and moe_metrics(plain) == moe_metrics(replayed)
    assert any(r["moe/dropped_tokens/layer_1"] for r in moe_metrics(plain).values()), "the capacity dropped some"
    assert state_sha256(replayed / "checkpoints" / "step-000004") == state_sha256(
        plain.run_dir / "checkpoints" / "step-000004")
