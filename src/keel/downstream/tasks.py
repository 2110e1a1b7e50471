"""Downstream tasks through lm-evaluation-harness: the tasks named (lm-eval's own, keel's shipped ones, or YAML task
files in the `include` directories), run on an lm-eval model, their scores as flat `TASK/METRIC` numbers."""

from __future__ import annotations

import functools
import importlib.util
import itertools
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from keel.downstream.hub import hub_offline, offline_hint
from keel.errors import ConfigError

EXTRA = "pip install 'keel-pretrain[eval]'"
# keel's own tasks (keel.downstream.stdlib_tasks), installed with the package: always beside the include directories
SHIPPED = Path(__file__).resolve().parents[1] / "configs" / "tasks"


def with_shipped(include: list[str]) -> list[str]:
    """The include directories, keel's shipped tasks' first."""
    return [str(SHIPPED), *(path for path in include if Path(path).resolve() != SHIPPED)]


def natively(tasks: list[str], include: list[str], num_fewshot: int | None) -> bool:
    """Whether keel scores the tasks itself (keel.downstream.native): only its shipped ones, zero-shot, where
    lm-eval is not installed (where it is, lm-eval scores every task)."""
    return (importlib.util.find_spec("lm_eval") is None and bool(tasks) and set(tasks) <= set(shipped_tasks())
            and not include and not num_fewshot)


def _lm_eval_tasks() -> Path:
    """lm-eval's own task directory, once lm-eval imports (a one-line error without it)."""
    try:
        import lm_eval.tasks
    except ImportError:
        raise ConfigError(f"downstream evaluation needs lm-evaluation-harness: {EXTRA}") from None
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its notes on building tasks are not the user's concern
    return Path(lm_eval.tasks.__file__).parent


def shipped_tasks() -> list[str]:
    return sorted(path.stem for path in SHIPPED.glob("*.yaml"))


def _task_manager(include: list[str], tasks: list[str]) -> Any:
    """lm-eval's task index with the `include` directories' YAML tasks (directories `check_tasks` checked).
    When the directories hold every task named (as tasks, not groups or tags that may name lm-eval's own), the
    index of the directories alone: indexing lm-eval's thousands of task files takes seconds."""
    if include:
        own = _indexed(tuple(include), with_lm_eval=False)
        if set(tasks) <= set(own.all_subtasks):
            return own
    return _indexed(tuple(include), with_lm_eval=True)


def task_files(root: Path) -> Iterator[Path]:
    """The files under lm-eval's task directory that its task YAML may be read from: the *.yaml files and what they
    include, whatever its name (templates such as `_template_yaml`); everything but Python and Markdown."""
    return (p for p in root.rglob("*") if p.suffix not in (".py", ".pyc", ".md") and p.is_file())


def _yaml_files(root: Path) -> Iterator[Path]:
    """The YAML of an include directory (*.yaml and templates), not its data files, which may be large."""
    return (p for p in root.rglob("*") if "yaml" in p.name and p.is_file())


def _written_nowhere(tasks: list[str], include: list[str]) -> list[str]:
    """The tasks that no task file so much as mentions, of the include directories or lm-eval's: unknown for
    certain, since lm-eval's index takes every name (task, group, tag) from YAML that writes it out. Reading
    lm-eval's 8 MB of task files as bytes takes a fraction of a second, its index seconds, so a mistyped name is
    refused at once."""
    root = _lm_eval_tasks()
    missing = {t.encode() for t in tasks}
    files = itertools.chain((p for path in include for p in _yaml_files(Path(path))), task_files(root))
    for path in files:
        text = path.read_bytes()
        missing = {name for name in missing if name not in text}
        if not missing:
            break
    return [t for t in tasks if t.encode() in missing]


@functools.lru_cache(maxsize=4)
def _indexed(include: tuple[str, ...], with_lm_eval: bool) -> Any:
    """Built once per process (a worker checks the tasks before it trains, and evaluates them later)."""
    from lm_eval.tasks import TaskManager

    with warnings.catch_warnings():  # lm-eval 0.4.13 deprecates `verbosity`; the older ones keel allows log without it
        warnings.simplefilter("ignore", DeprecationWarning)
        return TaskManager(include_path=list(include) or None, include_defaults=with_lm_eval, verbosity="ERROR")


def check_tasks(tasks: list[str], include: list[str]) -> Any:
    """The task manager, once every task is known to it (lm-eval's, keel's shipped ones or the include
    directories')."""
    if not tasks:
        raise ConfigError(f"no tasks given; name lm-eval tasks (e.g. hellaswag,arc_easy), keel's own "
                          f"({', '.join(shipped_tasks())}) or tasks of --include")
    for path in include:
        if not Path(path).is_dir():
            raise ConfigError(f"task directory {path!r} does not exist; give a directory of lm-eval task YAML files")
    include = with_shipped(include)
    offline = hub_offline()  # before lm-eval imports datasets, which reads the offline settings once
    manager, unknown = None, _written_nowhere(tasks, include)
    if not unknown:
        manager = _task_manager(include, tasks)
        unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        given = include[1:]
        where = f", nor in {', '.join(given)}" if given else " (pass --include DIR for task files of your own)"
        raise ConfigError(f"unknown task {', '.join(map(repr, unknown))}: not an lm-eval task, nor keel's "
                          f"({', '.join(shipped_tasks())}){where}")
    if offline:
        _check_cached(tasks, manager)
    return manager


def _check_cached(tasks: list[str], manager: Any) -> None:
    """Without the Hub, each task's data must be local or in the datasets cache: built once here (at once, offline),
    so that a task that needs a download is named before a model is loaded or a worker starts."""
    for task in tasks:
        with warnings.catch_warnings(), offline_hint([task], shipped_tasks()):
            warnings.simplefilter("ignore", DeprecationWarning)  # lm-eval 0.4.13 prefers TaskManager.load
            manager.load_task_or_group([task])


def scores(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """lm-eval's results as {task: {metric: value}}: `acc,none` → `acc`, `exact_match,strict` →
    `exact_match_strict`, standard errors as `METRIC_stderr`."""
    flat: dict[str, dict[str, float]] = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            name, _, filt = key.partition(",")
            if not isinstance(value, int | float) or isinstance(value, bool) or not filt:
                continue
            name = name if filt == "none" else f"{name}_{filt}"
            flat.setdefault(task, {})[name] = float(value)
    return flat


def run_tasks(lm: Any, tasks: list[str], include: list[str], limit: int | None = None,
              num_fewshot: int | None = None, stderr: bool = True, manager: Any = None) -> dict[str, dict[str, float]]:
    """Each task's scores for `lm` ({} on a process of local rank other than 0). `stderr=False` skips the
    bootstrap of standard errors (in training)."""
    from lm_eval import simple_evaluate

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    manager = manager or check_tasks(tasks, include)
    with offline_hint(tasks, shipped_tasks()):  # the Hub went out of reach since the tasks were checked
        results = simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                  num_fewshot=num_fewshot, log_samples=False, bootstrap_iters=1000 if stderr else 0,
                                  verbosity="ERROR")
    # lm-eval keeps the scores on the process of local rank 0 (the others ran the same requests for the collectives)
    return {} if results is None else scores(results)
