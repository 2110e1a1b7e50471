"""torchft's lighthouse, started as a script of its own: `python lighthouse.py --min_replicas N ...`.

torchft's console script imports the whole torchft package, and with it torch: seconds that a lighthouse
started again after a failure would keep every replica group waiting. This loads torchft's extension alone
(the lighthouse reads its options from the process's arguments, past the interpreter's)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

EXTENSION = "torchft._torchft"


def extension() -> Path | None:
    """torchft's compiled extension, found without importing torchft (None when torchft is not installed)."""
    spec = importlib.util.find_spec("torchft")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(folder).glob("_torchft*.so"))
        if found:
            return found[0]
    return None


def command(min_replicas: int, bind: str, join_timeout_s: float, heartbeat_timeout_s: float) -> list[str]:
    """The command that starts a lighthouse listening on `bind` (HOST:PORT), its quorum ticking every 100 ms."""
    return [sys.executable, __file__, "--min_replicas", str(min_replicas), "--bind", bind, "--quorum_tick_ms", "100",
            "--join_timeout_ms", str(int(join_timeout_s * 1000)),
            "--heartbeat_timeout_ms", str(int(heartbeat_timeout_s * 1000))]


def main() -> int:
    path = extension()
    if path is None:
        print("torchft is not installed: pip install 'keel-pretrain[ft]'", file=sys.stderr)
        return 2
    loader = importlib.machinery.ExtensionFileLoader(EXTENSION, str(path))
    spec = importlib.util.spec_from_file_location(EXTENSION, path, loader=loader)
    assert spec is not None  # a file location with a loader always makes a spec
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return int(module.lighthouse_main() or 0)


if __name__ == "__main__":
    sys.exit(main())
