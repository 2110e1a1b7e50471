"""The private parts of torchrun's agent that keel's launcher calls, each with why. They are kept apart from
keel.core.torch_private, whose imports load DTensor and the activation-checkpoint wrapper: the launcher loads
no worker code (tests/dist/test_startup.py)."""

from __future__ import annotations

from typing import Any

__all__ = ["respawn_worker", "worker_processes"]


def worker_processes(pcontext: Any) -> list[Any]:
    """torchrun's worker processes (multiprocessing's, by local rank) once its agent has started them; the
    agent's process context keeps them under a private name."""
    context = getattr(pcontext, "_pc", None)
    return list(context.processes) if context is not None else []


def respawn_worker(pcontext: Any, local_rank: int, env: dict[str, str]) -> int:
    """Start local rank `local_rank` of torchrun's worker processes again, alone, in the place of its ended
    process and with `env` added to its environment; the agent's poll then watches the new one. torchrun's
    agent only ever restarts all its workers together, and its process context is private. Returns the pid."""
    import importlib
    import multiprocessing

    from torch.distributed.elastic.multiprocessing import api as elastic_api

    spawn = importlib.import_module("torch.multiprocessing.spawn")  # the module; the package exports its function

    context = pcontext._pc
    pcontext.envs[local_rank] = {**pcontext.envs[local_rank], **env}
    args = (pcontext.entrypoint, pcontext.args, pcontext.envs, pcontext.stdouts, pcontext.stderrs,
            pcontext._ret_vals, pcontext._worker_finished_event, pcontext._numa_options)
    process = multiprocessing.get_context(pcontext.start_method).Process(
        target=spawn._wrap, args=(elastic_api._wrap, local_rank, args, context.error_files[local_rank]))
    process.start()
    context.sentinels.pop(context.processes[local_rank].sentinel, None)
    context.sentinels[process.sentinel] = local_rank
    context.processes[local_rank] = process
    return int(process.pid)
