"""The cluster's own figures for `keel plan`: its network, how fast it notices and recovers from a failure,
how often its accelerators fail, its spare nodes, its storage, its price and its memory allocator's
fragmentation; from flags, a TOML file
(`--cluster FILE`, the same names), or the defaults below, each with its source (docs/planning.md). A file
that `keel plan --measure` wrote also holds what it measured: the efficiency factors fitted on this machine,
and for an accelerator without published figures (a CPU) its peak and link bandwidth; one that
`keel plan --calibrate-sweep` wrote, the kernels' figures and the links' bandwidth measured here (and a CPU's
peak and memory bandwidth).

A flag wins over the file, the file over the default. Every figure is checked (finite, in range) before
anything is planned: one line naming it and what would do.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from keel.errors import KeelError
from keel.plan.cost import DEFAULT_PRICE_PER_HOUR
from keel.plan.failure_rates import PUBLISHED_MIX, TRIAGE_H
from keel.plan.failures import DEFAULT_MEMORY_COVERAGE, FailureMix, Recovery
from keel.plan.kernels import FIGURES
from keel.plan.throughput import Efficiency

YEAR_H = 365 * 24.0
MAX_SPARES = 100_000


@dataclass(frozen=True)
class Cluster:
    # GB/s per accelerator, one direction, across nodes (None: the accelerator catalog's typical figure).
    net_gbps: float | None = None
    # Accelerators one scale-up fabric joins: a node's NVLink, an NVL72 rack, a TPU slice (None: the catalog's)
    fabric_devices: float | None = None
    detect_s: float = Recovery.detect_s  # a failure noticed: heartbeat/watchdog timeouts
    restart_s: float = Recovery.restart_s  # reschedule, start every rank, communicator init, warm-up
    repair_h: float = Recovery.repair_s / 3600  # a failed node back: drain, diagnose, swap, burn-in
    spares: int | None = None  # hot spare nodes (None: auto, as many as pay for themselves)
    # hours of one accelerator per job interruption (None: its generation's published runs, failure_rates)
    mtbf_hours: float | None = None
    storage_gbps: float = 2000.0  # aggregate checkpoint write bandwidth (Llama 3's 2 TB/s)
    price: float = DEFAULT_PRICE_PER_HOUR  # per accelerator-hour
    fragmentation: float = 0.05  # memory the allocator reserves beyond its allocated peak, a share of it
    memory_coverage: float = DEFAULT_MEMORY_COVERAGE  # p_m: the share of failures the memory tier restores
    # How failures show and what finding them costs (keel.plan.failure_rates: the published figures)
    hang_share: float = PUBLISHED_MIX.hang  # found only at a collective's timeout
    hang_detect_s: float = Recovery.hang_detect_s
    silent_share: float = PUBLISHED_MIX.silent  # silent data corruption
    silent_detect_s: float | None = None  # None: keel's own guard latency at the planned step time
    manual_share: float = PUBLISHED_MIX.manual  # a person diagnoses it
    triage_h: float = TRIAGE_H
    rollbacks_per_day: float = 0.0  # loss spikes rolled back, per day of compute
    # Measured (`keel plan --measure`), None where not: the efficiency factors (keel.plan.throughput.Efficiency),
    # and an accelerator's dense peak and link bandwidth within a node where its catalog entry has none (a CPU).
    compute_efficiency: float | None = None
    overlap: float | None = None
    link_efficiency: float | None = None
    peak_tflops: float | None = None
    intra_gbps: float | None = None
    memory_gbps: float | None = None  # and its memory bandwidth (`keel plan --calibrate-sweep`)
    # The kernels' figures on this cluster (keel.plan.kernels.Kernels), each in place of its generation's where given
    gemm_efficiency: float | None = None
    gemm_fp8_efficiency: float | None = None
    attention_forward_efficiency: float | None = None
    attention_backward_efficiency: float | None = None
    memory_efficiency: float | None = None

    def recovery(self) -> Recovery:
        return Recovery(detect_s=self.detect_s, restart_s=self.restart_s, repair_s=self.repair_h * 3600,
                        hang_detect_s=self.hang_detect_s, triage_s=self.triage_h * 3600)

    def mix(self) -> FailureMix:
        return FailureMix(hang=self.hang_share, silent=self.silent_share, manual=self.manual_share,
                          rollbacks_per_day=self.rollbacks_per_day)

    def kernel_figures(self) -> dict[str, float]:
        """The kernel figures the file gives, by `keel.plan.kernels.with_figures`'s names."""
        return {name: value for name in FIGURES if (value := getattr(self, f"{name}_efficiency")) is not None}

    def efficiency(self) -> Efficiency | None:
        """The efficiency factors the file holds (all three, or none: the planner's defaults then)."""
        compute, overlap, link = self.compute_efficiency, self.overlap, self.link_efficiency
        if compute is not None and overlap is not None and link is not None:
            return Efficiency(compute=compute, overlap=overlap, link=link, source="measured (the cluster file)")
        if compute is None and overlap is None and link is None:
            return None
        raise KeelError("--cluster: compute_efficiency, overlap and link_efficiency go together (as `keel plan "
                        "--measure` writes them); give all three or none")


# name → (lowest, whether the lowest itself is allowed, highest, what it is)
LIMITS: dict[str, tuple[float, bool, float, str]] = {
    "net_gbps": (0.0, False, 10_000.0, "GB/s per accelerator across nodes"),
    "fabric_devices": (1.0, True, 1e6, "accelerators one scale-up fabric joins, a whole number"),
    "detect_s": (0.0, True, YEAR_H * 3600, "seconds to notice a failure"),
    "restart_s": (0.0, True, YEAR_H * 3600, "seconds to restart the job"),
    "repair_h": (0.0, True, YEAR_H, "hours to repair a failed node"),
    "mtbf_hours": (0.0, False, 1e9, "hours of one accelerator between interruptions"),
    "storage_gbps": (0.0, False, 1e6, "GB/s of aggregate checkpoint writes"),
    "price": (0.0, True, 1e6, "price per accelerator-hour"),
    "fragmentation": (0.0, True, 1.0, "share of the peak the memory allocator reserves beyond it"),
    "memory_coverage": (0.0, True, 1.0, "share of the failures the memory tier restores"),
    "hang_share": (0.0, True, 1.0, "share of the failures that show as hangs"),
    "hang_detect_s": (0.0, True, YEAR_H * 3600, "seconds until a hang times out"),
    "silent_share": (0.0, True, 1.0, "share of the failures that are silent data corruption"),
    "silent_detect_s": (0.0, True, YEAR_H * 3600, "seconds until a silent corruption is found"),
    "manual_share": (0.0, True, 1.0, "share of the failures a person diagnoses"),
    "triage_h": (0.0, True, YEAR_H, "hours of a person's diagnosis"),
    "rollbacks_per_day": (0.0, True, 1e4, "loss-spike rollbacks per day of compute"),
    "compute_efficiency": (0.0, False, 2.0, "share of the peak the forward and backward reach"),
    "overlap": (0.0, True, 1.0, "share of the FSDP and data-parallel traffic hidden under compute"),
    "link_efficiency": (0.0, False, 2.0, "share of the link bandwidth collectives reach"),
    "peak_tflops": (0.0, False, 1e6, "dense peak TFLOP/s of one accelerator"),
    "intra_gbps": (0.0, False, 10_000.0, "GB/s per accelerator within a node"),
    "memory_gbps": (0.0, False, 100_000.0, "GB/s of an accelerator's memory"),
    "gemm_efficiency": (0.0, False, 1.0, "share of the bf16 peak a large GEMM reaches"),
    "gemm_fp8_efficiency": (0.0, False, 1.0, "share of the fp8 peak a large GEMM reaches"),
    "attention_forward_efficiency": (0.0, False, 1.0, "share of the bf16 peak the attention kernel's forward reaches"),
    "attention_backward_efficiency": (0.0, False, 1.0, "share of the bf16 peak its backward reaches"),
    "memory_efficiency": (0.0, False, 1.0, "share of the memory bandwidth element-wise kernels reach"),
}
MEASURED = ("compute_efficiency", "overlap", "link_efficiency", "peak_tflops", "intra_gbps", "memory_gbps")  # no flags
# How failures show: the cluster file's figures only (a team's own operations, rarely changed per question)
OPERATIONS = ("hang_share", "hang_detect_s", "silent_share", "silent_detect_s", "manual_share", "triage_h",
              "rollbacks_per_day")
TOPOLOGY = ("fabric_devices",)  # the file's only, as the operations': a cluster's, not a question's
KERNEL_FIGURES = tuple(f"{name}_efficiency" for name in FIGURES)  # the file's only, as the operations'
FLAGS = {name: "--" + name.replace("_", "-") for name in [*LIMITS, "spares"]
         if name not in MEASURED + OPERATIONS + KERNEL_FIGURES + TOPOLOGY}
FLAGS["mtbf_hours"], FLAGS["price"] = "--mtbf-hours", "--price"


def checked(name: str, value: Any, where: str) -> Any:
    """`value` for the figure `name` when valid; else one line naming `where` it came from."""
    if name == "spares":
        if value in (None, "auto"):
            return None
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SPARES:
            raise KeelError(f"{where} {value!r}: expected auto or a number of spare nodes from 0 to {MAX_SPARES:,}")
        return value
    low, inclusive, high, what = LIMITS[name]
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or \
            not (low <= value if inclusive else low < value) or value > high or \
            (name in TOPOLOGY and not float(value).is_integer()):
        bound = f"{'at least' if inclusive else 'above'} {low:g} and at most {high:g}"
        raise KeelError(f"{where} {value!r}: expected a finite number {bound} ({what})")
    return float(value)


def read_cluster(path: Path) -> dict[str, Any]:
    """The figures of a cluster file, checked: a TOML table of the names above."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise KeelError(f"--cluster {path}: cannot be read ({e.strerror or e})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise KeelError(f"--cluster {path}: not valid TOML ({e})") from None
    known = [f.name for f in fields(Cluster)]
    for key in data:
        if key not in known:
            raise KeelError(f"--cluster {path}: unknown figure {key!r}; expected some of {', '.join(known)}")
    return {key: checked(key, value, f"--cluster {path}: {key} =") for key, value in data.items()}


def cluster_from(path: Path | None, flags: dict[str, Any]) -> Cluster:
    """The cluster: the defaults, then the file's figures, then the flags given (None: not given)."""
    values = read_cluster(path) if path is not None else {}
    for name, value in flags.items():
        if value is not None:
            values[name] = checked(name, value, FLAGS[name])
    cluster = Cluster(**values)
    if cluster.hang_share + cluster.silent_share > 1:
        raise KeelError(f"--cluster {path}: hang_share {cluster.hang_share:g} + silent_share "
                        f"{cluster.silent_share:g} exceed every failure; together they must be at most 1")
    return cluster


def write_cluster(path: Path, cluster: Cluster, sources: dict[str, str]) -> Path:
    """`cluster` as a file `--cluster` reads: every figure it has, each with where it came from as a comment."""
    lines = []
    for f in fields(Cluster):
        value = getattr(cluster, f.name)
        if value is None:
            continue
        note = f"  # {sources[f.name]}" if f.name in sources else ""
        lines.append(f"{f.name} = {value!r}{note}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    return path
