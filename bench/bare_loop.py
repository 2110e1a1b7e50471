"""A bare torchrun FSDP2 training loop: the baseline bench/step_overhead.py holds `keel train` against.

    python -m torch.distributed.run --standalone --nproc-per-node N bench/bare_loop.py \
        --config C --out F [KEY=VALUE ...]

It trains what `keel train` trains from the same config and overrides, and nothing more: the same model class
and initialisation (keel.model.llama.Llama, keel.model.init.init_weights, weights filled after sharding), AdamW
with keel's settings (keel.train.optim.build_optimizer) and schedule (lr_at), `fully_shard` on every block and
then the root when there is more than one process (as keel.parallel.apply does; one process wraps nothing),
the same precision and deterministic kernels, the loss averaged over the rank's micro-batches, the gradients
clipped to the global norm. The data are the same prepared token shards read plainly (numpy memmaps) in the
order keel's loader gives a one-source corpus: epoch e is the permutation of the training split's sequences
seeded by (seed, e), global batch b is the next global_batch sequences of the concatenated epochs, and each
rank takes its contiguous slice of it. Read in the training thread, without prefetch, checksums or mixture
bookkeeping: what a hand-written loop does.

Rank 0 writes JSON lines to --out: {"started": t} (this file's first line ran), then {"step": n, "time": t,
"loss": rank 0's loss} once step n is done (the loss is read on the host, so the step has finished).
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports, as keel records keel.STARTED

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from keel.config import Config, load_config  # noqa: E402
from keel.model.init import init_weights  # noqa: E402
from keel.model.llama import Llama  # noqa: E402
from keel.train.optim import build_optimizer, lr_at  # noqa: E402


class SequenceOrder:
    """The training split's sequences of seq_len + 1 tokens (consecutive ones share a boundary token), in
    the global order of keel's loader for a corpus of one source."""

    def __init__(self, data_dir: Path, seq_len: int, global_batch: int, seed: int) -> None:
        manifest = json.loads((data_dir / "manifest.json").read_text())
        files = [f for f in manifest["files"] if f["split"] == "train"]
        if len({f.get("source", "main") for f in files}) != 1:
            raise SystemExit(f"{data_dir}: the bare loop reads a corpus of one source only")
        self.shards = [np.memmap(data_dir / f["name"], dtype=manifest["dtype"], mode="r") for f in files]
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.starts = np.cumsum([0] + [(len(s) - 1) // seq_len for s in self.shards])
        self.count = int(self.starts[-1])
        self.epoch, self.perm = -1, np.empty(0, dtype=np.int64)

    def sequence(self, number: int) -> np.ndarray:
        shard = int(np.searchsorted(self.starts, number, side="right")) - 1
        first = (number - int(self.starts[shard])) * self.seq_len
        return self.shards[shard][first:first + self.seq_len + 1]

    def batch(self, number: int) -> np.ndarray:
        """Global batch `number` (from 0), (global_batch, seq_len + 1) int64 tokens."""
        rows = []
        for position in range(number * self.global_batch, (number + 1) * self.global_batch):
            if position // self.count != self.epoch:
                self.epoch = position // self.count
                self.perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.count)
            rows.append(self.sequence(int(self.perm[position % self.count])))
        return np.stack(rows).astype(np.int64)


def clip_to_global_norm(params: list[torch.nn.Parameter], max_norm: float) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if isinstance(norm, DTensor):  # sharded gradients: the local norm is a partial sum
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE, as for keel train")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    cuda = torch.cuda.is_available() and cfg.train.device != "cpu"
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        train(cfg, device, args.out)
    finally:
        dist.destroy_process_group()


def train(cfg: Config, device: torch.device, out_path: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = open(out_path, "a") if rank == 0 else None  # noqa: SIM115 - written at every step
    if out:
        out.write(json.dumps({"started": STARTED}) + "\n")
    bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device.type == "cuda")
    param_dtype = torch.bfloat16 if bf16 else torch.float32
    with torch.device("meta"):
        model = Llama(cfg.model)
    if world > 1:
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for block in model.layers.values():
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    model.to_empty(device=device)
    init_weights(model, cfg.train.seed)
    optimizer = build_optimizer(model, cfg.optim)
    params = list(model.parameters())
    data = SequenceOrder(Path(cfg.data.dir), cfg.train.seq_len, cfg.train.global_batch, cfg.train.seed)
    per_rank = cfg.train.global_batch // world
    for step in range(cfg.train.steps):
        tokens = torch.from_numpy(data.batch(step)[rank * per_rank:(rank + 1) * per_rank])
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.optim, cfg.train.steps)
        loss = train_step(model, optimizer, params, tokens.split(cfg.train.micro_batch), cfg.optim.grad_clip, bf16,
                          device)
        if out:
            out.write(json.dumps({"step": step + 1, "time": time.time(), "loss": loss}) + "\n")
            out.flush()
    if out:
        out.close()


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
               micro_batches: tuple[torch.Tensor, ...], grad_clip: float, bf16: bool, device: torch.device) -> float:
    """Forward and backward of each micro-batch, the clip, the update; returns the rank's mean loss."""
    loss_sum = torch.zeros((), device=device)
    for chunk in micro_batches:
        chunk = chunk.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(chunk[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten()) / len(micro_batches)
        loss.backward()
        loss_sum += loss.detach()
    if grad_clip > 0:
        clip_to_global_norm(params, grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum.item()


if __name__ == "__main__":
    main()
