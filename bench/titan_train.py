"""torchtitan 0.3.0's trainer on keel's shapes, batch and sequence: what bench/gpu_check.py launches.

    python -m torch.distributed.run --standalone --nproc-per-node 1 bench/titan_train.py SPEC.json

SPEC.json (written by bench/titan_run.py from a keel config) names the torchtitan Llama 3 flavour of the same
shapes and the run: sequence length, micro-batch (torchtitan's local batch), global batch (gradient
accumulation over micro-batches), steps, logging interval, compile. This file builds torchtitan's own
Trainer.Config in Python, as its config_registry functions do, and runs torchtitan's Trainer as
torchtitan/train.py does (its command line parser is left out: every setting is here). What is torchtitan's own
is kept: its model of that flavour (fused QKV, FlexAttention, per-block compile, compiled chunked loss),
FSDP's mixed precision policy at one rank (bf16 compute, fp32 weights), CUDA graphs of the forward and backward,
AdamW. Set to match keel: no activation checkpointing, no checkpoint, no validation. Its data are uniform
random tokens, each sequence one document (a tokenizer and a data set are all that torchtitan would read from
the network): the cost of a step does not depend on the tokens.

It prints torchtitan's log, whose lines "step: N loss: ... memory: X GiB(P%) tps: T ..." bench/titan_run.py
parses. Needs torchtitan 0.3.0 and a CUDA device; imports torchtitan only when run.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def shapes_of(model: Any) -> dict[str, Any]:
    """The shapes of a built torchtitan Llama3Model.Config, named as in the spec."""
    first = model.layers[0]
    return {"dim": model.dim, "n_layers": len(model.layers), "vocab_size": model.vocab_size,
            "n_heads": first.attention.n_heads, "n_kv_heads": first.attention.n_kv_heads,
            "ffn_hidden": first.feed_forward.w1.out_features, "tie_embeddings": model.enable_weight_tying}


def trainer_config(spec: dict[str, Any]) -> Any:
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    model_spec = model_registry(spec["flavor"])
    return Trainer.Config(
        model_spec=model_spec, dump_folder=spec["dump_folder"], hf_assets_path=spec["dump_folder"],
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(
            global_vocab_size=decoder_vocab_size(model_spec))),
        tokenizer=tokenizer_class().Config(vocab_size=spec["vocab_size"]),
        dataloader=loader_class().Config(),
        optimizer=default_adamw(lr=spec["lr"]),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=spec["warmup_steps"]),
        training=TrainingConfig(local_batch_size=spec["micro_batch"], global_batch_size=spec["global_batch"],
                                seq_len=spec["seq_len"], steps=spec["steps"], max_norm=spec["grad_clip"]),
        metrics=MetricsProcessor.Config(log_freq=spec["log_freq"], disable_color_printing=True),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,
        compile=CompileConfig(enable=spec["compile"], components=["model", "loss"]))


def tokenizer_class() -> Any:
    """A tokenizer of the model's vocabulary that is never asked to encode: the data are token ids already."""
    from torchtitan.components.tokenizer import BaseTokenizer

    class Ids(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 0

        def __init__(self, config: Any, **_: Any) -> None:
            super().__init__()
            self.vocab_size = config.vocab_size

        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            raise NotImplementedError("the benchmark's data are token ids")

        def decode(self, *args: Any, **kwargs: Any) -> str:
            raise NotImplementedError("the benchmark's data are token ids")

        def get_vocab_size(self) -> int:
            return self.vocab_size

    return Ids


def loader_class() -> Any:
    """Endless batches of uniform random token ids, each row one document (positions 0..seq_len-1)."""
    import torch
    from torchtitan.components.dataloader import BaseDataLoader

    class RandomTokens(BaseDataLoader):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(self, config: Any, *, tokenizer: Any, seq_len: int, local_batch_size: int, dp_rank: int,
                     **_: Any) -> None:
            self.vocab, self.shape = tokenizer.get_vocab_size(), (local_batch_size, seq_len + 1)
            self.generator = torch.Generator().manual_seed(dp_rank)

        def __iter__(self) -> Any:
            positions = torch.arange(self.shape[1] - 1).expand(self.shape[0], -1)
            while True:
                tokens = torch.randint(self.vocab, self.shape, generator=self.generator)
                yield {"input": tokens[:, :-1], "positions": positions}, tokens[:, 1:]

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

    return RandomTokens


def main(spec_path: str) -> None:
    import torch
    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    spec = json.loads(Path(spec_path).read_text())
    config = trainer_config(spec)
    built = shapes_of(config.model_spec.model)
    wanted = {key: spec[key] for key in built}
    if built != wanted:  # the flavour must be keel's model, or the comparison means nothing
        raise SystemExit(f"titan_train: torchtitan's {spec['flavor']} is {built}, not keel's {wanted}")
    logger.info(f"titan_train: flavour {spec['flavor']} has keel's shapes {built}")
    trainer = config.build()
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
