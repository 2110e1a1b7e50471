"""Real `keel` processes for drills: each launch is tagged so that everything it started (torchrun's
workers run in sessions of their own) can be found and ended, whatever happens to the launcher."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

TAG = "KEEL_DRILL_TAG"


def keel_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    src = str(Path(__file__).resolve().parents[2])  # keel importable in the children as it is here
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    return {**env, **(extra or {})}


def tagged(tag: str, var: str = TAG) -> list[int]:
    """Live processes carrying `tag` in their environment variable `var`: a process and everything it started,
    torchrun's workers included (they run in sessions of their own, out of reach of killpg)."""
    marker = f"{var}={tag}".encode()
    pids = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker in environ.read_bytes().split(b"\0"):
                pids.append(int(environ.parent.name))
        except OSError:
            continue
    return pids


def kill_tagged(tag: str, wait_s: float = 10.0, var: str = TAG) -> None:
    """SIGKILL every process carrying `tag` and wait until they are gone: a process with many threads takes a
    moment to die, and one started meanwhile is killed too."""
    deadline = time.monotonic() + wait_s
    while (pids := tagged(tag, var)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


class Launch:
    """`python -m keel ARGS` (or the `program` given) in its own session, output to `log`; a context manager that
    leaves nothing behind. `prefix` runs it through another command that then executes it (`ip netns exec NS`)."""

    def __init__(self, args: list[str], cwd: Path, log: Path, env: dict[str, str] | None = None,
                 prefix: list[str] | None = None, program: list[str] | None = None) -> None:
        self.tag = uuid.uuid4().hex
        self.started = time.time()
        self.log = open(log, "a")  # noqa: SIM115 - closed in __exit__
        program = program or [sys.executable, "-m", "keel"]
        self.proc = subprocess.Popen([*(prefix or []), *program, *args], cwd=cwd, stdout=self.log,
                                     stderr=subprocess.STDOUT, env=keel_env({**(env or {}), TAG: self.tag}),
                                     start_new_session=True)

    def __enter__(self) -> Launch:
        return self

    def __exit__(self, *exc: object) -> None:
        kill_tagged(self.tag)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self.log.close()

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None if it ran past `timeout` (then everything it started is killed)."""
        try:
            return self.proc.wait(timeout=max(0.0, timeout - (time.time() - self.started)))
        except subprocess.TimeoutExpired:
            kill_tagged(self.tag)
            return None

    def leftovers(self, grace_s: float = 2.0) -> list[int]:
        """What still lives `grace_s` after the launcher ended (a dying process takes a moment to go)."""
        deadline = time.monotonic() + grace_s
        while (pids := tagged(self.tag)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return pids
