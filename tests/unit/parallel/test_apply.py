"""Tensor parallelism of float8 layers: a tensorwise layer takes torchao's float8 style (its input all-gathered
in float8, on CUDA), every other style stays as the model declares it."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from keel.model.float8 import convert_to_float8
from keel.model.llama import Llama
from keel.parallel.apply import float8_style
from tests.unit.model.test_float8 import WIDE

pytest.importorskip("torchao")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_tensorwise_float8_layers_take_the_float8_styles_with_the_declared_layouts(recipe: str) -> None:
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    model = Llama(WIDE)
    convert_to_float8(model, recipe, emulate=True, fsdp=False)
    plan, block = model.parallel_plan(), model.layers["0"]
    styles = {name: float8_style(block, name, style) for name, style in plan.block.items()}
    wq, wo = styles["attention.wq"], styles["attention.wo"]
    if recipe == "rowwise":  # scaled per row of the gathered input: the plain styles
        assert styles == plan.block
        return
    assert type(wq) is Float8ColwiseParallel and type(wo) is Float8RowwiseParallel
    assert wo.output_layouts == (Shard(1),) and wo.use_local_output == plan.block["attention.wo"].use_local_output
    assert styles["attention_norm"] is plan.block["attention_norm"]  # not a linear layer
    plain = Llama(WIDE)  # no float8 layers: nothing changes
    assert all(float8_style(plain.layers["0"], name, style) is style for name, style in plan.block.items()
               if isinstance(style, ColwiseParallel | RowwiseParallel))
