"""A node's reach to its elastic job's rendezvous, the one address every node must reach. A node that cannot
connect to it for `window_s` is cut off from the job (its cable pulled, its switch port or its network down):
the other nodes drop it from the rendezvous, as it sends them no keep-alive, and go on without it, while torch's
agent on this node would wait on the unreachable store for minutes. The watch tells it to leave instead, and
`until_answered` when it can come back.

Only silence counts: a refused connection means the rendezvous host answered (its job may have just ended), and
a link that comes back within the window (a flap) costs the job a wait, not a node."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable


def _silence(address: tuple[str, int], timeout_s: float) -> str | None:
    """None when the host at `address` answered within `timeout_s` (a refusal is an answer), else what the
    attempt met."""
    try:
        socket.create_connection(address, timeout=timeout_s).close()
    except ConnectionRefusedError:
        return None
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def _address(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


def until_answered(endpoint: str, limit_s: float, poll_s: float = 1.0) -> float | None:
    """Blocks until the rendezvous at `endpoint` answers: the seconds it took, or None when it stayed silent for
    `limit_s`."""
    started = time.monotonic()
    while _silence(_address(endpoint), poll_s) is not None:
        if time.monotonic() - started > limit_s:
            return None
        time.sleep(poll_s)
    return time.monotonic() - started


class ReachWatch:
    """Connects to `endpoint` (HOST:PORT) every `poll_s` on a daemon thread; calls `lost(why)` once, when it has
    had no answer for `window_s`, on that thread."""

    def __init__(self, endpoint: str, window_s: float, lost: Callable[[str], None], poll_s: float = 1.0) -> None:
        self.address, self.window_s, self.lost, self.poll_s = _address(endpoint), window_s, lost, poll_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._declared = False
        self._thread = threading.Thread(target=self._run, name="keel-reach", daemon=True)

    def start(self) -> ReachWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """No more watching; once the node was declared lost, waits for `lost` to return (it decides what the
        node does next, and the process must not end under it)."""
        with self._lock:
            self._stop.set()
            declared = self._declared
        if declared:
            self._thread.join()

    def _run(self) -> None:
        answered = time.monotonic()
        while not self._stop.wait(self.poll_s):
            failure = _silence(self.address, self.poll_s)
            if failure is None:
                answered = time.monotonic()
            elif time.monotonic() - answered > self.window_s:
                with self._lock:
                    if self._stop.is_set():
                        return
                    self._declared = True
                self.lost(f"the rendezvous at {self.address[0]}:{self.address[1]} has not answered for "
                          f"{time.monotonic() - answered:.0f} s ({failure})")
                return
