"""The launcher's word to the workers about a generation of the process group (keel.core.generations), through
a real TCP store as the launcher holds one."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from keel.core import generations


@pytest.fixture
def launcher_store(monkeypatch: pytest.MonkeyPatch) -> dist.TCPStore:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    monkeypatch.setenv(generations.STORE_ENV, f"127.0.0.1:{store.port}")
    monkeypatch.setenv(generations.ROUND_ENV, "3")
    return store


def test_a_worker_learns_the_ranks_a_generation_replaces_once_announced(launcher_store: dist.TCPStore,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    assert generations.enabled()
    assert generations.announced(1, wait_s=0.1) is None, "nothing announced yet: the failure was not a peer's death"
    generations.announce(launcher_store, 1, [1, 3])
    assert generations.announced(1) == [1, 3]
    assert generations.announced(2, wait_s=0.1) is None
    monkeypatch.setenv(generations.ROUND_ENV, "4")
    assert generations.announced(1, wait_s=0.1) is None, "another start of the workers has generations of its own"


def test_a_replacement_joins_the_generation_its_environment_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(generations.STORE_ENV, raising=False)
    monkeypatch.delenv(generations.GENERATION_ENV, raising=False)
    assert (generations.enabled(), generations.joined()) == (False, 0)
    monkeypatch.setenv(generations.GENERATION_ENV, "2")
    assert generations.joined() == 2
