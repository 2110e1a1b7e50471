"""Preflight: what must hold before a run spends the cluster's time, checked at every start and restart.

- checkpoint storage: writable, free space for `keep_last + 1` checkpoints (of the newest one's size),
  write and read-back throughput
  (one rank per node writes a probe file, reads it back and compares);
- collectives: an all-reduce and an all-gather of known per-rank values; a rank whose result is wrong,
  or whose part arrives wrong at the others, is named; the all-reduce bus bandwidth is reported;
- compute: a fixed matmul timed on every rank; a rank slower than `SLOW_FACTOR` × the median is named;
- host memory available; GPUs through NVML when present (ECC errors, throttling, temperature).

Every rank gathers every result, so every rank takes the same branch. With `health.preflight = fail`
a failed check ends the run naming the node and rank: a storage failure is bad input (exit 2); a
node's own fault (wrong collective, slow compute, memory, GPU) also lists the node in quarantine.json
and exits 76, so that an elastic job goes on without it. With `warn` it is reported and the run goes
on. The results are a `preflight` event.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from keel.checkpoint.memory import BYTES_PER_PARAMETER
from keel.config import Config
from keel.errors import EXIT_QUARANTINE, KeelError
from keel.rundir.events import EventLog
from keel.rundir.quarantine import add_to_quarantine, node_name

SLOW_FACTOR = 2.0  # compute probe: a rank this many times slower than the median is named
GPU_MAX_TEMP_C = 85


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    rank: int = -1  # the rank at fault (or checked); -1: the rank that ran the check
    node: str = ""
    values: dict[str, Any] = field(default_factory=dict)


STORAGE_CHECKS = ("storage_writable", "storage_readback", "storage_free")


def checkpoint_bytes(n_params: int) -> int:
    """A checkpoint holds fp32 parameters and two fp32 Adam moments: 12 bytes per parameter."""
    return BYTES_PER_PARAMETER * n_params


def run_preflight(cfg: Config, checkpoint_dir: str, n_params: int, events: EventLog, say: Callable[[str], None],
                  corrupt: Callable[[torch.Tensor], None] | None = None, device: torch.device | None = None
                  ) -> list[Check]:
    """All ranks call it together. Returns every rank's checks (the same list on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = device or torch.device("cpu")
    probe_bytes = cfg.health.preflight_probe_mib << 20
    mine: list[Check] = []
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one per node: the node's view of the storage
        keep = cfg.checkpoint.keep_last + 1  # what retention holds, and the save being written beside them
        one = last_checkpoint_bytes(checkpoint_dir, n_params)
        mine += storage_checks(checkpoint_dir, keep * one, proportionate(probe_bytes, one),
                               f"{keep} checkpoints (checkpoint.keep_last + 1)")
        mine.append(host_memory_check(cfg.health.min_host_memory_gib))
    if device.type == "cuda":
        mine += gpu_checks(device)
    mine.append(compute_probe(device))
    # A step's reduction moves the fp32 gradients: 4 bytes per parameter.
    mine += collective_checks(proportionate(probe_bytes, 4 * n_params), device, corrupt)
    for check in mine:
        if check.rank < 0:
            check.rank, check.node = rank, node_name()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, [asdict(c) for c in mine])
    checks = blame_senders([Check(**c) for per_rank in gathered for c in per_rank])
    checks += slow_ranks(checks)
    failed = [c for c in checks if not c.ok]
    if rank == 0:
        events.emit("preflight", 0, "failed" if failed else "passed", mode=cfg.health.preflight,
                    checks=[asdict(c) for c in checks])
    for c in failed:
        say(f"preflight: {c.name} FAILED on node {c.node} rank {c.rank}: {c.detail}")
    summary = [c for c in checks if c.ok and c.rank == 0 and c.name in ("storage_throughput", "allreduce_bandwidth")]
    if summary:
        say("preflight: " + "; ".join(c.detail for c in summary))
    return checks


def proportionate(probe_bytes: int, job_bytes: int) -> int:
    """A probe no larger than what the job itself moves (a checkpoint, a step's gradients): whole MiB, at
    least one, at most `probe_bytes` (health.preflight_probe_mib)."""
    return max(1 << 20, min(probe_bytes, job_bytes) >> 20 << 20)


def verdict(checks: list[Check], mode: str, run_dir: Path, rank: int) -> int | None:
    """With `mode = fail`: raise for bad storage, or quarantine the nodes at fault and return 76."""
    failed = [c for c in checks if not c.ok]
    if not failed or mode != "fail":
        return None
    storage = [c for c in failed if c.name in STORAGE_CHECKS]
    if storage:
        c = storage[0]
        raise KeelError(f"preflight check {c.name} failed on node {c.node} rank {c.rank}: {c.detail} "
                        f"(health.preflight = \"warn\" reports it and goes on)")
    if rank == 0:
        for c in failed:
            add_to_quarantine(run_dir, [c.node], source="preflight", reason=f"{c.name}: {c.detail}", ranks=[c.rank])
    return EXIT_QUARANTINE


def last_checkpoint_bytes(directory: str, n_params: int) -> int:
    """The size of the newest checkpoint in `directory`, or the estimate when it holds none. Its files' sizes, as
    the directory lists them: no file of it is opened (a restart served by the memory tier reads no storage)."""
    from keel.checkpoint.manifest import committed
    from keel.checkpoint.storage import Storage

    if "://" in directory:  # listing an object store is left to the first save
        return checkpoint_bytes(n_params)
    storage = Storage(directory)
    names = committed(storage)
    size = sum(storage.files(names[-1]).values()) if names else 0
    return size or checkpoint_bytes(n_params)


def storage_checks(directory: str, need_bytes: int, probe_bytes: int, need: str = "two checkpoints") -> list[Check]:
    """Probe where the checkpoints will go: the directory, or the nearest existing one above it that
    the run will create it in (the probe creates nothing and leaves nothing behind)."""
    if "://" in directory:
        return [Check("storage_writable", True, f"{directory}: object storage, probed by the first save")]
    path = Path(directory).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    if not path.is_dir():
        return [Check("storage_writable", False, f"cannot write to the checkpoint directory {directory}: "
                      f"{path} is not a directory")]
    free = shutil.disk_usage(path).free
    size = max(1 << 20, min(probe_bytes, free // 10)) >> 20 << 20  # whole MiB, never a tenth of the free space
    probe = path / f".preflight-{node_name()}-{os.getpid()}"
    data = os.urandom(1 << 20) * (size >> 20)
    try:
        started = time.perf_counter()
        with open(probe, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        write_s = time.perf_counter() - started
        started = time.perf_counter()
        back = probe.read_bytes()
        read_s = time.perf_counter() - started
    except OSError as e:
        return [Check("storage_writable", False, f"cannot write to the checkpoint directory {directory}: "
                      f"{e.strerror or e}")]
    finally:
        with contextlib.suppress(OSError):  # never written (a read-only volume refuses even the unlink)
            probe.unlink()
    checks = [Check("storage_writable", True, f"{directory} is writable")]
    if hashlib.sha256(back).digest() != hashlib.sha256(data).digest():
        checks.append(Check("storage_readback", False, f"a probe file written to {directory} read back different"))
    mib = len(data) / 2**20
    checks.append(Check("storage_throughput", True, f"checkpoint storage writes {mib / write_s:.0f} MiB/s and reads "
                        f"{mib / read_s:.0f} MiB/s", values={"write_mib_s": mib / write_s,
                                                             "read_mib_s": mib / read_s}))
    checks.append(Check("storage_free", free >= need_bytes, f"{free / 2**30:.2f} GiB free in {directory}, {need} "
                        f"need {need_bytes / 2**30:.2f} GiB",
                        values={"free_bytes": free, "need_bytes": need_bytes}))
    return checks


def host_memory_check(min_gib: float) -> Check:
    import psutil

    available = psutil.virtual_memory().available
    return Check("host_memory", available >= min_gib * 2**30,
                 f"{available / 2**30:.1f} GiB of host memory available (at least {min_gib:g} GiB needed)",
                 values={"available_bytes": available})


def compute_probe(device: torch.device, n: int = 256, repeats: int = 8) -> Check:
    a = torch.randn(n, n, device=device)
    (a @ a).sum().item()  # warm up
    started = time.perf_counter()
    for _ in range(repeats):
        a = torch.tanh(a @ a)
    a.sum().item()
    seconds = time.perf_counter() - started
    return Check("compute_probe", True, f"{repeats} matmuls of {n}×{n} in {seconds * 1e3:.1f} ms",
                 values={"seconds": seconds})


def slow_ranks(checks: list[Check]) -> list[Check]:
    times = {c.rank: c.values["seconds"] for c in checks if c.name == "compute_probe"}
    if len(times) < 2:
        return []
    median = statistics.median(times.values())
    return [Check("compute_speed", False, f"its compute probe took {t / median:.1f}× the median rank's "
                  f"({t * 1e3:.1f} ms vs {median * 1e3:.1f} ms)", rank=r,
                  node=next(c.node for c in checks if c.rank == r)) for r, t in times.items()
            if t > SLOW_FACTOR * median]


def blame_senders(checks: list[Check]) -> list[Check]:
    """A part that arrived wrong is its sender's fault: one check per sender, on the sender's node. A
    wrong all-reduce result is explained by such a sender; without one, the ranks with a wrong result
    are named when they are a minority (their receiving side), else no rank can be told apart."""
    nodes = {c.rank: c.node for c in checks if c.name == "compute_probe"}
    receivers: dict[int, list[int]] = {}
    for c in checks:
        if c.name == "allgather_correct":
            receivers.setdefault(c.values["sender"], []).append(c.values["receiver"])
    wrong_sums = [c for c in checks if c.name == "allreduce_correct"]
    kept = [c for c in checks if c.name != "allgather_correct" and (c.name != "allreduce_correct" or (
        not receivers and len(wrong_sums) * 2 < len(nodes)))]
    if wrong_sums and not receivers and len(wrong_sums) * 2 >= len(nodes):
        kept.append(Check("allreduce_correct", False, f"all-reduce result wrong on {len(wrong_sums)} of "
                          f"{len(nodes)} ranks; no rank could be told apart", rank=0, node=nodes.get(0, "?")))
    return kept + [Check("allgather_correct", False, f"its part of an all-gather arrived wrong at rank(s) "
                         f"{', '.join(map(str, sorted(at)))}" + (f", and the all-reduce result was wrong on "
                                                                  f"{len(wrong_sums)} rank(s)" if wrong_sums else ""),
                         rank=sender, node=nodes.get(sender, "?")) for sender, at in sorted(receivers.items())]


PATTERN = 1021  # a prime: no power-of-two block of a probe, moved or repeated, lines up with it again


def _pattern(rank: int) -> torch.Tensor:
    """Known to every rank: small integers, so that sums are exact in fp32."""
    return torch.randint(0, 64, (PATTERN,), generator=torch.Generator().manual_seed(1000 + rank)).float()


def _tiled(pattern: torch.Tensor, numel: int, device: torch.device) -> torch.Tensor:
    """`pattern` repeated over `numel` elements: a probe costs a copy to make, not a random draw per element,
    and a wrong element is found wherever it lies."""
    return pattern.repeat(-(-numel // PATTERN))[:numel].to(device)


def _rank_values(rank: int, numel: int, device: torch.device) -> torch.Tensor:
    return _tiled(_pattern(rank), numel, device)


def collective_checks(probe_bytes: int, device: torch.device,
                      corrupt: Callable[[torch.Tensor], None] | None) -> list[Check]:
    rank, world = dist.get_rank(), dist.get_world_size()
    numel = max(1024, probe_bytes // 4)
    expected = _tiled(torch.stack([_pattern(r) for r in range(world)]).sum(0), numel, device)
    mine = _rank_values(rank, numel, device)
    if corrupt is not None:
        corrupt(mine)
    checks = []
    # All-gather: the others' parts, as they arrive here. A part that differs names its sender.
    small = mine[:1024].clone()
    parts = [torch.empty_like(small) for _ in range(world)]
    dist.all_gather(parts, small)
    bad = [r for r, part in enumerate(parts) if not torch.equal(part, _rank_values(r, 1024, device))]
    for sender in bad:
        checks.append(Check("allgather_correct", False, f"the part from rank {sender} arrived wrong at rank {rank}",
                            rank=sender, values={"sender": sender, "receiver": rank}))
    # All-reduce: correctness here, and the bus bandwidth (2(n-1)/n of the bytes cross each link).
    buffer = mine  # the parts above are copies
    dist.barrier()
    started = time.perf_counter()
    dist.all_reduce(buffer)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    wrong = 0 if torch.equal(buffer, expected) else int((buffer != expected).sum())
    if wrong:
        checks.append(Check("allreduce_correct", False, f"all-reduce result wrong in {wrong} of {numel} elements"))
    if world > 1:  # one process moves nothing: no bandwidth to report
        busbw = 2 * (world - 1) / world * numel * 4 / seconds
        checks.append(Check("allreduce_bandwidth", True, f"all-reduce of {numel * 4 / 2**20:.0f} MiB over {world} "
                            f"ranks at {busbw / 1e9:.2f} GB/s bus bandwidth", values={"busbw_gbs": busbw / 1e9}))
    return checks


def gpu_checks(device: torch.device) -> list[Check]:
    try:
        import pynvml
    except ImportError:
        return [Check("gpu_nvml", True, "nvidia-ml-py not installed (pip install 'keel-pretrain[gpu]'): GPU checks "
                      "skipped")]
    try:
        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        checks = []
        try:
            ecc = pynvml.nvmlDeviceGetTotalEccErrors(handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                     pynvml.NVML_VOLATILE_ECC)
            checks.append(Check("gpu_ecc", ecc == 0, f"GPU {index}: {ecc} uncorrected ECC errors since boot"))
        except pynvml.NVMLError:
            checks.append(Check("gpu_ecc", True, f"GPU {index}: ECC counts not exposed"))
        temp = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
        checks.append(Check("gpu_temperature", temp < GPU_MAX_TEMP_C, f"GPU {index}: {temp} °C"))
        reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)
        bad = reasons & (pynvml.nvmlClocksThrottleReasonHwSlowdown | pynvml.nvmlClocksThrottleReasonSwThermalSlowdown
                         | pynvml.nvmlClocksThrottleReasonHwThermalSlowdown)
        checks.append(Check("gpu_throttle", not bad, f"GPU {index}: clock throttle reasons 0x{reasons:x}"))
        return checks
    except pynvml.NVMLError as e:
        return [Check("gpu_nvml", False, f"NVML failed: {e}")]
