"""Tasks whose data come from the Hugging Face Hub, on a machine that may not reach it.

Without network access, `datasets` retries each request for about 25 s before it gives up with a long traceback.
So before lm-eval (and through it `datasets` and `huggingface_hub`, which read these settings once, when
imported) is loaded, one connection to the Hub (HF_ENDPOINT, or the HTTPS proxy) is tried; if it fails,
HF_HUB_OFFLINE and HF_DATASETS_OFFLINE are set for this process and those it starts, and `datasets` reads its
cache at once. A task whose data are not there is then one line naming it and how to run it offline.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from collections.abc import Iterator
from urllib.parse import urlparse

from keel.errors import ConfigError

OFFLINE_FLAGS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
PROBE_TIMEOUT_S = 3.0
# What a failed download raises, by class name (requests, httpx, huggingface_hub and the builtins; the first
# three are optional packages of different versions).
DOWNLOAD_ERRORS = {"ConnectionError", "ConnectTimeout", "ReadTimeout", "ConnectError", "ProxyError", "TimeoutError",
                   "gaierror", "OfflineModeIsEnabled", "LocalEntryNotFoundError"}


def _is_true(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _hub_address() -> tuple[str, int]:
    """Where a request to the Hub goes first: the HTTPS proxy when one is set, else the Hub's endpoint."""
    proxy = next((os.environ[k] for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
                  if os.environ.get(k)), None)
    url = urlparse(proxy or os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)


@functools.cache
def hub_offline() -> bool:
    """Whether the Hub is out of reach (offline by setting, or no connection within PROBE_TIMEOUT_S); if so, the
    offline settings are made for this process and those it starts. Tried once per process."""
    if not any(_is_true(os.environ.get(flag)) for flag in OFFLINE_FLAGS):
        try:
            socket.create_connection(_hub_address(), timeout=PROBE_TIMEOUT_S).close()
            return False
        except OSError:
            pass
    os.environ.update({flag: "1" for flag in OFFLINE_FLAGS})
    return True


def download_failure(error: BaseException) -> str | None:
    """What went wrong, when `error` (or one it was raised from) is a download that failed; None otherwise."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ConnectionError | TimeoutError) or type(seen).__name__ in DOWNLOAD_ERRORS:
            text = str(seen).strip()
            return text.splitlines()[0] if text else type(seen).__name__
        seen = seen.__cause__ or seen.__context__
    return None


@contextlib.contextmanager
def offline_hint(tasks: list[str], local: list[str]) -> Iterator[None]:
    """A failed download of the data of `tasks` as one line: the task and how to run it without the Hub
    (`local`: tasks that need no download)."""
    try:
        yield
    except Exception as e:
        reason = download_failure(e)
        if reason is None:
            raise
        named = f"task {tasks[0]!r}" if len(tasks) == 1 else f"one of the tasks {', '.join(map(repr, tasks))}"
        raise ConfigError(f"{named} needs data from the Hugging Face Hub, which cannot be reached from here "
                          f"({reason}); run it once where the Hub is reachable (the data stay in the datasets "
                          f"cache, HF_HOME, which later runs read offline), or run tasks with local data: keel's "
                          f"own ({', '.join(local)}) or task files of --include DIR") from None
