"""The experiment trackers keel logs to, each registered by its own module of this package with
`@tracker(NAME)` on its backend class: every module of the package is imported to find them, so that a
tracker is added by its file alone. A tracker is configured by the config's section `monitor.NAME` (its
`enabled` switches it on); its client library is imported only where the tracker is enabled, on the
tracker's thread, so that a disabled tracker costs nothing and needs nothing installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from keel.config import Config
from keel.core.registry import Registry
from keel.errors import ConfigError


class Backend(Protocol):
    """One tracker's client. Every method runs on the tracker's own thread and may raise."""

    def open(self, saved: dict | None) -> dict:
        """Start a run, or continue the one `saved` describes; returns what identifies it for a resume."""
        ...

    def config(self, cfg: Config, resumed: bool) -> None: ...
    def metrics(self, step: int, values: dict[str, float], time_s: float) -> None: ...
    def event(self, step: int, kind: str, text: str) -> None: ...
    def link(self, key: str, value: str) -> None: ...
    def artifact(self, path: Path) -> None: ...
    def close(self, ended: str) -> None: ...


class BackendClass(Protocol):
    """What `@tracker` registers: a backend made from its config section (`monitor.NAME`), the tracker run's
    name, the config's name and the run directory. Making one starts nothing: `open` does."""

    def __call__(self, section: Any, run_name: str, config_name: str, run_dir: Path, /) -> Backend: ...


@dataclass(frozen=True)
class Kind:
    make: BackendClass
    client: str | None  # the module of its client library, checked before any worker starts (None: none needed)
    extra: str  # keel-pretrain's extra that installs the client


B = TypeVar("B", bound=BackendClass)

BACKENDS: Registry[Kind] = Registry("keel.monitor.tracking", "tracker")


def tracker(name: str, client: str | None = None, extra: str | None = None) -> Callable[[B], B]:
    """Registers a backend class as the tracker `name`, configured by `monitor.NAME`; `client` is the module of
    its client library, if it has one, and `extra` (`client` unless given) keel-pretrain's extra that installs
    it."""

    def register(cls: B) -> B:
        BACKENDS.add(name, Kind(cls, client, extra or client or ""))
        return cls

    return register


def section(cfg: Config, name: str) -> Any:
    """The tracker's config section; None where the config has none (the tracker cannot be enabled)."""
    return getattr(cfg.monitor, name, None)


def enabled_trackers(cfg: Config) -> list[str]:
    return [name for name in BACKENDS.all() if getattr(section(cfg, name), "enabled", False) is True]


def check_trackers(cfg: Config) -> None:
    """Every enabled tracker's client is installed: checked before any worker starts."""
    kinds = BACKENDS.all()
    for name in enabled_trackers(cfg):
        kind = kinds[name]
        if kind.client is not None and importlib.util.find_spec(kind.client) is None:
            raise ConfigError(f"monitor.{name}.enabled = true needs the {kind.client} package: pip install "
                              f"'keel-pretrain[{kind.extra}]', or set monitor.{name}.enabled = false")


def make_backend(name: str, cfg: Config, run_dir: Path) -> Backend:
    kinds = BACKENDS.all()
    if name not in kinds:
        raise ConfigError(f"unknown tracker {name!r}; expected one of {', '.join(kinds)}")
    return kinds[name].make(section(cfg, name), run_name(run_dir), cfg.name, run_dir)


def run_name(run_dir: Path) -> str:
    """A tracker run's name: its run directory's (the whole run's, for a replica group's RUN_DIR/groups/G), so
    that the runs of one config in several directories (a sweep by hand) are told apart; the config's name
    is a tag."""
    path = run_dir.resolve()
    if path.parent.name == "groups" and path.name.isdigit():
        path = path.parent.parent
    return path.name
