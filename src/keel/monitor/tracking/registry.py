"""The experiment trackers keel logs to, each declared by its own module of this package: its config section
(a dataclass with `enabled` and its options, each declared with `keel.config.option`) and its backend class,
registered together by `@tracker(NAME, config=SECTION)` on the class. Every module of the package is imported
to find them, by keel.config too whenever a config is made, so that a tracker is added by its file alone: its
section is `[monitor.NAME]` of the config (`monitor.NAME.enabled` switches it on). Its client library is
imported only where the tracker is enabled, on the tracker's thread, so that a disabled tracker costs nothing
and needs nothing installed; an enabled one whose client is missing is refused before any worker starts, with
what to install.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from keel.config import Config, MonitorConfig
from keel.config.sections import add_section
from keel.core.registry import Registry
from keel.errors import ConfigError


class Backend(Protocol):
    """One tracker's client. Every method runs on the tracker's own thread and may raise."""

    def open(self, saved: dict | None, key: str) -> dict:
        """Start a run, or continue the one `saved` describes (None: no start of this keel run kept one); returns
        what identifies it for a resume. `key` names this keel run's tracker run for good, and is kept before the
        run is started: a tracker that can names or tags its run with it, so that a start stopped between
        starting the run and keeping its ids continues that run instead of starting a second one."""
        ...

    def config(self, cfg: Config) -> None: ...
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
    package: str  # what `pip install` installs the client from


B = TypeVar("B", bound=BackendClass)

BACKENDS: Registry[Kind] = Registry("keel.monitor.tracking", "tracker")


def tracker(name: str, config: type, client: str | None = None, package: str | None = None) -> Callable[[B], B]:
    """Registers a backend class as the tracker `name`, configured by the section `monitor.NAME` that the
    dataclass `config` declares (its `enabled` switches the tracker on); `client` is the module of its client
    library, if it has one, and `package` (`client` unless given) the distribution that installs it."""
    if not dataclasses.is_dataclass(config) or typing.get_type_hints(config).get("enabled") is not bool:
        raise TypeError(f"the section of the tracker {name!r}, {config.__name__}, needs a field `enabled: bool`")

    def register(cls: B) -> B:
        add_section(MonitorConfig, name, config)
        BACKENDS.add(name, Kind(cls, client, package or client or ""))
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
            raise ConfigError(f"monitor.{name}.enabled = true needs the {kind.client} package: "
                              f"{install_hint(name, kind.package)}, or set monitor.{name}.enabled = false")


def install_hint(name: str, package: str) -> str:
    """What installs a tracker's client: keel-pretrain's extra of the tracker's name where the installed keel
    has one (it holds the versions keel is tested with), else the client's own package."""
    try:
        extras = importlib.metadata.metadata("keel-pretrain").get_all("Provides-Extra") or []
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        extras = []
    return f"pip install 'keel-pretrain[{name}]'" if name in extras else f"pip install {package}"


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
