"""A node's reach to its elastic job's rendezvous, the one address every node must reach. A node that cannot
connect to it for `window_s` is cut off from the job (its cable pulled, its switch port or its network down):
the other nodes drop it from the rendezvous, as it sends them no keep-alive, and go on without it, while torch's
agent on this node would wait on the unreachable store for minutes. The watch tells it to leave instead.

Only silence counts: a refused connection means the rendezvous host answered (its job may have just ended), and
a link that comes back within the window (a flap) costs the job a wait, not a node."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable


class ReachWatch:
    """Connects to `endpoint` (HOST:PORT) every `poll_s` on a daemon thread; calls `lost(why)` once, when it has
    had no answer for `window_s`."""

    def __init__(self, endpoint: str, window_s: float, lost: Callable[[str], None], poll_s: float = 1.0) -> None:
        host, _, port = endpoint.rpartition(":")
        self.address, self.window_s, self.lost, self.poll_s = (host, int(port)), window_s, lost, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="keel-reach", daemon=True)

    def start(self) -> ReachWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _answers(self) -> str | None:
        """None when the rendezvous host answered (a refusal is an answer), else what the attempt met."""
        try:
            socket.create_connection(self.address, timeout=self.poll_s).close()
        except ConnectionRefusedError:
            return None
        except OSError as e:
            return e.strerror or type(e).__name__
        return None

    def _run(self) -> None:
        answered = time.monotonic()
        while not self._stop.wait(self.poll_s):
            failure = self._answers()
            if failure is None:
                answered = time.monotonic()
            elif time.monotonic() - answered > self.window_s and not self._stop.is_set():
                self.lost(f"the rendezvous at {self.address[0]}:{self.address[1]} has not answered for "
                          f"{time.monotonic() - answered:.0f} s ({failure})")
                return
