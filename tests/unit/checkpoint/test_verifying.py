"""Which files of a checkpoint each rank checks before it loads."""

from __future__ import annotations

from keel.checkpoint.verifying import share

FILES = [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "rng-rank-00000.pt", "rng-rank-00001.pt",
         "rng-rank-00002.pt", "train_state.json"]


def test_with_the_number_of_processes_that_saved_it_each_rank_checks_the_files_it_wrote() -> None:
    assert share(FILES, 0, 3, 3) == ["__0_0.distcp", "rng-rank-00000.pt", "train_state.json"]
    assert share(FILES, 2, 3, 3) == ["__2_0.distcp", "rng-rank-00002.pt"]


def test_with_another_number_of_processes_the_files_are_dealt_out_and_each_is_checked_once() -> None:
    shares = [share(FILES, rank, 2, 3) for rank in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(FILES[1:]) and abs(len(shares[0]) - len(shares[1])) <= 1
