"""A checkpoint tier spread over nodes, the parts that need no process group: who is whose buddy, what each node
holds, which steps the nodes hold whole between them, and the transfers that make each node's copy whole."""

from __future__ import annotations

from keel.checkpoint.spread import Nodes, held_by_node, restorable, transfers


def node_files(*ranks: int) -> list[str]:
    return ["train_state.json", *(f"flat-rank-{r:05d}.{kind}" for r in ranks for kind in ("bin", "json")),
            *(f"rng-rank-{r:05d}.pt" for r in ranks)]


def inventories(held: dict[int, dict[str, list[str]]], world: int = 4, local: int = 1) -> list[dict]:
    """One entry a rank, as `inventory` gathers them: each node's leader its node's copies, the others nothing;
    the manifest lists the files of every rank of `world`."""
    manifest = {"files": {f: {"size": 1} for f in node_files(*range(world))}}
    return [{name: (manifest, files) for name, files in held.get(r // local, {}).items()} if r % local == 0 else {}
            for r in range(world)]


def test_each_rank_keeps_the_files_of_the_same_local_rank_on_the_node_before() -> None:
    nodes = [Nodes(rank, 6, 2) for rank in range(6)]
    assert [n.count for n in nodes[:1]] == [3] and [n.leader for n in nodes] == [True, False] * 3
    assert [n.buddy for n in nodes] == [2, 3, 4, 5, 0, 1]
    assert [n.from_buddy for n in nodes] == [4, 5, 0, 1, 2, 3]
    # Each rank's report is what it put into its node's copy: its own files and its buddy-from's.
    reports = [node_files(r, (r - 2) % 6) for r in range(6)]
    assert held_by_node(reports, nodes[0])[0] == sorted(set(node_files(0, 1, 4, 5)))


def test_a_step_is_restorable_while_the_nodes_left_hold_its_files_between_them() -> None:
    # Four nodes of one rank, each holding its own files and its buddy-from's (the node before).
    held = {n: {"step-10": node_files(n, (n - 1) % 4)} for n in range(4)}
    assert restorable(inventories(held)) == ["step-10"]
    lost_one = {n: files for n, files in held.items() if n != 2}
    assert restorable(inventories(lost_one)) == ["step-10"], "node 3 holds node 2's files"
    lost_with_buddy = {n: files for n, files in held.items() if n not in (2, 3)}
    assert restorable(inventories(lost_with_buddy)) == [], "node 2's files were on nodes 2 and 3 only"


def test_each_node_pulls_what_it_lacks_from_the_first_node_that_holds_it() -> None:
    held = {0: {"step-10": node_files(0, 1)}, 1: {"step-10": node_files(1, 0)}}
    # Node 1 replaced: it holds nothing, and pulls every file from node 0, which holds them all.
    replaced = inventories({0: held[0]}, world=2)
    moves = transfers("step-10", replaced, Nodes(0, 2, 1))
    assert moves == [(0, 1, f) for f in sorted(node_files(0, 1))]
    assert transfers("step-10", inventories(held, world=2), Nodes(1, 2, 1)) == [], "whole already"
    # Two ranks a node: only the leaders move files, and every rank derives the same list.
    two = inventories({0: {"step-10": node_files(0, 1, 2, 3)}}, world=4, local=2)
    assert transfers("step-10", two, Nodes(3, 4, 2)) == [(0, 2, f) for f in sorted(node_files(0, 1, 2, 3))]
