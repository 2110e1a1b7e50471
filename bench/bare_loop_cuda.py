"""A bare compiled PyTorch training loop on one device: the floor bench/gpu_check.py holds keel against.

What a hand-written loop does with keel's model and nothing else: the same Llama class and initialisation
(keel.model.llama.Llama, keel.model.init.init_weights) in fp32 weights, each block compiled in place as keel
compiles them (Module.compile), bf16 autocast, AdamW with keel's settings (keel.train.optim.build_optimizer),
micro-batches accumulated into the global batch, the plain cross entropy over the full logits, the
gradients clipped to the global norm. Its data are uniform random token ids made on the device once (the cost
of a step does not depend on the tokens); no data loader, checkpoint, metric or guard. bench/bare_loop.py is
the multi-process FSDP2 loop of the same idea for bench/step_overhead.py.

train(cfg, device) runs cfg.train.steps steps and returns tokens/s (the median of the cfg.monitor.interval-step
windows after the first, which holds the compile) and, on CUDA, the peak memory allocated and reserved.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from keel.config import Config
from keel.model.init import init_weights
from keel.model.llama import Llama
from keel.train.optim import build_optimizer


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(cfg: Config, device: torch.device, compile_on: bool) -> tuple[Llama, torch.optim.Optimizer]:
    with torch.device("meta"):
        model = Llama(cfg.model)
    model.to_empty(device=device)
    init_weights(model, cfg.train.seed)
    if compile_on:
        for block in model.blocks().values():
            block.compile()
    return model, build_optimizer(model, cfg.optim)


def step(model: Llama, optimizer: torch.optim.Optimizer, batches: torch.Tensor, grad_clip: float) -> None:
    """One optimizer step over `batches`, (micro-batches, micro_batch, seq_len + 1) token ids."""
    for chunk in batches:
        with torch.autocast(chunk.device.type, dtype=torch.bfloat16):
            logits = model(chunk[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten()) / len(batches)
        loss.backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train(cfg: Config, device: torch.device, compile_on: bool = True) -> dict:
    t = cfg.train
    if t.global_batch % t.micro_batch:
        raise ValueError(f"global_batch {t.global_batch} is not a multiple of micro_batch {t.micro_batch}")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, optimizer = build(cfg, device, compile_on)
    generator = torch.Generator(device=device).manual_seed(t.seed)
    shape = (t.global_batch // t.micro_batch, t.micro_batch, t.seq_len + 1)
    batches = torch.randint(cfg.model.vocab_size, shape, device=device, generator=generator)
    every = max(cfg.monitor.interval, 1)
    rates, started = [], time.perf_counter()
    for number in range(1, t.steps + 1):
        step(model, optimizer, batches, cfg.optim.grad_clip)
        if number % every == 0:
            synchronize(device)
            now = time.perf_counter()
            rates.append(every * t.global_batch * t.seq_len / (now - started))
            started = now
    cuda = device.type == "cuda"
    out = {"exit_code": 0, "tokens_per_s": statistics.median(rates[1:]) if len(rates) > 1 else None,
           "windows": len(rates),
           "peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
           "peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None}
    del model, optimizer, batches
    return out
