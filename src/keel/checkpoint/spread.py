"""A checkpoint tier spread over the nodes of a job: the memory tier (keel.checkpoint.memory) on more than one
node, where each node's copy lives in that node's own memory.

Each rank writes its files into its own node's copy, and sends them to its buddy, the rank of the same local
rank on the next node, which writes them into its node's copy too; the file every rank shares
(`train_state.json`) reaches every node. So every file is held by two nodes, and the loss of one node leaves all
of them on the others. A node's manifest is the checkpoint's whole manifest, with `held` listing the files that
node holds; its checks (keel.checkpoint.manifest.check_files) cover those.

A restore first agrees, from every node's inventory, on the checkpoints whose files the nodes hold between
them, and completes each node's copy from the others (`complete`) before it loads: a replacement node, which
holds nothing, pulls its ranks' files from their buddy. The transfers run over the job's process group, one
pair at a time in one order that every rank derives alike, so no two of them wait on each other."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from keel.checkpoint.manifest import HELD, MANIFEST, checkpoints, manifest_json, read_manifest, writer_rank
from keel.checkpoint.storage import Storage

SHARED = ("train_state.json",)  # written once by rank 0, needed on every node


@dataclass(frozen=True)
class Nodes:
    """The job's nodes as torchrun lays out ranks: `local` consecutive ranks a node."""

    rank: int
    world: int
    local: int

    @classmethod
    def here(cls) -> Nodes:
        world = dist.get_world_size()
        return cls(dist.get_rank(), world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))

    @property
    def count(self) -> int:
        return self.world // self.local

    def node(self, rank: int) -> int:
        return rank // self.local

    @property
    def leader(self) -> bool:
        """This rank manages its node's copy (makes its directories, commits and prunes it)."""
        return self.rank % self.local == 0

    @property
    def buddy(self) -> int:
        return (self.rank + self.local) % self.world

    @property
    def from_buddy(self) -> int:
        """The rank whose files this one keeps."""
        return (self.rank - self.local) % self.world


def replicate(storage: Storage, staging: str, nodes: Nodes, group: dist.ProcessGroup) -> tuple[list[str], str]:
    """Every rank of the writer `group` calls this once its files are written into `staging` on its node: its
    own files go to its buddy, its buddy-from's come here, and rank 0's shared files reach every node's leader.
    Returns the files this rank put into its node's copy (its own, its buddy-from's, the shared ones) and what
    went wrong here (empty: nothing); the collectives run to their end whatever this node's volume does."""
    present = storage.files(staging)
    own = sorted(f for f in present if writer_rank(f) == nodes.rank and (nodes.rank or f not in SHARED))
    listed: list = [None] * nodes.world
    dist.all_gather_object(listed, [(f, present[f]) for f in own], group=group)
    incoming = listed[nodes.from_buddy]
    buffers = [torch.empty(size, dtype=torch.uint8) for _, size in incoming]
    works = [dist.isend(torch.frombuffer(bytearray(storage.read_bytes(f"{staging}/{f}")), dtype=torch.uint8),
                        nodes.buddy, group=group) for f in own]
    works += [dist.irecv(buffer, nodes.from_buddy, group=group) for buffer in buffers]
    for work in works:
        if work is not None:
            work.wait()
    shared: list[dict[str, bytes]] = [
        {f: storage.read_bytes(f"{staging}/{f}") for f in SHARED if f in present} if nodes.rank == 0 else {}]
    dist.broadcast_object_list(shared, src=0, group=group)
    kept = {fname: buffer.numpy().tobytes() for (fname, _), buffer in zip(incoming, buffers, strict=True)}
    if nodes.leader and nodes.rank != 0:
        kept.update(shared[0])
    try:
        for fname, data in kept.items():
            storage.write_durably(f"{staging}/{fname}", data)
    except OSError as e:
        return own, f"the copy of a peer's files on this node failed ({e.strerror or e})"
    return [*own, *kept, *(shared[0] if nodes.rank == 0 else {})], ""


def held_by_node(reports: list[list[str]], nodes: Nodes) -> dict[int, list[str]]:
    """Each node's files, from what each rank said it put into its node's copy."""
    held: dict[int, set[str]] = {}
    for rank, files in enumerate(reports):
        held.setdefault(nodes.node(rank), set()).update(files)
    return {node: sorted(files) for node, files in held.items()}


def node_manifest(manifest: dict, held: list[str]) -> bytes:
    return manifest_json({**manifest, HELD: held})


# ---------------------------------------------------------------------------------------------------- restoring


def inventory(storage: Storage, nodes: Nodes, group: dist.ProcessGroup | None = None
              ) -> list[dict[str, tuple[dict, list[str]]]]:
    """Every node's committed copies (name -> its manifest and the files it holds), as its leader sees them;
    one entry a rank (the others' empty). Every rank calls this."""
    mine: dict[str, tuple[dict, list[str]]] = {}
    if nodes.leader:
        for name in checkpoints(storage):
            manifest = read_manifest(storage, name)
            if manifest is not None and "unreadable" not in manifest:
                mine[name] = (manifest, list(manifest.get(HELD, manifest["files"])))
    everyone: list = [None] * nodes.world
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def _manifest(name: str, inventories: list[dict[str, tuple[dict, list[str]]]]) -> dict:
    """The manifest of copy `name`, from the first node that holds one."""
    return next(held[name][0] for held in inventories if name in held)


def restorable(inventories: list[dict[str, tuple[dict, list[str]]]]) -> list[str]:
    """The copies whose files the nodes hold between them, oldest first."""
    names = sorted({name for held in inventories for name in held})
    whole = []
    for name in names:
        manifest = _manifest(name, inventories)
        there = {f for held in inventories if name in held for f in held[name][1]}
        if set(manifest["files"]) <= there:
            whole.append(name)
    return whole


def transfers(name: str, inventories: list[dict[str, tuple[dict, list[str]]]], nodes: Nodes
              ) -> list[tuple[int, int, str]]:
    """(source leader, destination leader, file): what each node's leader pulls so that its copy of `name` holds
    every file, each from the first node that holds it. The same list on every rank."""
    leaders = range(0, nodes.world, nodes.local)
    manifest = _manifest(name, inventories)
    holders: dict[str, int] = {}
    for leader in leaders:
        for fname in inventories[leader].get(name, ({}, []))[1]:
            holders.setdefault(fname, leader)
    moves = []
    for leader in leaders:
        here = set(inventories[leader].get(name, ({}, []))[1])
        moves += [(holders[f], leader, f) for f in sorted(manifest["files"]) if f not in here]
    return moves


def complete(storage: Storage, name: str, inventories: list[dict[str, tuple[dict, list[str]]]], nodes: Nodes,
             group: dist.ProcessGroup | None = None) -> int:
    """Make this node's copy of `name` whole, pulling what it lacks from the nodes that hold it; then its
    manifest lists every file. Every rank calls this; returns the bytes the nodes pulled from each other."""
    manifest = _manifest(name, inventories)
    received = 0
    if nodes.leader:
        storage.makedirs(name)
    for src, dst, fname in transfers(name, inventories, nodes):
        if nodes.rank == src:
            data = bytearray(storage.read_bytes(f"{name}/{fname}"))
            dist.send(torch.frombuffer(data, dtype=torch.uint8), dst, group=group)
        elif nodes.rank == dst:
            buffer = torch.empty(manifest["files"][fname]["size"], dtype=torch.uint8)
            dist.recv(buffer, src, group=group)
            storage.write_durably(f"{name}/{fname}", buffer.numpy().tobytes())
            received += buffer.numel()
    if nodes.leader and HELD in (read_manifest(storage, name) or {HELD: None}):
        # Written last: until then the copy says which files it holds, and a crash leaves it consistent.
        storage.write_durably(f"{name}/{MANIFEST}", manifest_json({k: v for k, v in manifest.items() if k != HELD}))
    everyone: list = [None] * nodes.world
    dist.all_gather_object(everyone, received, group=group)
    return sum(everyone)
