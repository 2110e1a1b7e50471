"""The Llama model declares its own blocks and tensor-parallel plan: every module the plan names is one the
model (or the pipeline stage) holds, and the optional ones are named exactly when the model has them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from keel.model.llama import Llama
from keel.parallel.pipeline import stage_module
from tests.unit.model.test_model import TINY


def assert_plan_names_only_held_modules(model: Llama) -> None:
    plan = model.parallel_plan()
    for path in plan.top:
        model.get_submodule(path)  # raises AttributeError for a module the model does not hold
    for key, block in model.blocks().items():
        for path in [*plan.block, *plan.by_block.get(key, {})]:
            block.get_submodule(path)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("embedding_norm", ["none", "scale", "rmsnorm"])
def test_llamas_plan_names_its_qk_norm_and_embedding_norm_only_when_it_has_them(qk_norm: bool,
                                                                               embedding_norm: str) -> None:
    with torch.device("meta"):
        model = Llama(dataclasses.replace(TINY, qk_norm=qk_norm, embedding_norm=embedding_norm))
    assert_plan_names_only_held_modules(model)
    plan = model.parallel_plan()
    assert set(plan.top) == {"tok_embeddings", "norm", "output"} | ({"embedding_norm"} if embedding_norm == "rmsnorm"
                                                                    else set())
    assert ("attention.q_norm" in plan.block, "attention.k_norm" in plan.block) == (qk_norm, qk_norm)
    assert model.blocks() is model.layers


def test_a_pipeline_stage_plans_only_the_modules_it_holds() -> None:
    with torch.device("meta"):
        model = Llama(dataclasses.replace(TINY, n_layers=3, embedding_norm="rmsnorm"))
    stages = [stage_module(model, stage, 3) for stage in range(3)]
    for stage in stages:
        assert_plan_names_only_held_modules(stage)
    assert [set(stage.parallel_plan().top) for stage in stages] == [
        {"tok_embeddings", "embedding_norm"}, set(), {"norm", "output"}]
    assert [list(stage.blocks()) for stage in stages] == [["0"], ["1"], ["2"]]
