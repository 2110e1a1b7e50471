"""The failure catalog: each scenario is a real fault, the promise recovery makes about it, and the clean
run its outcome must match."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from keel.errors import EXIT_QUARANTINE

BITWISE = "bitwise"  # the final state equals the clean run's, bit for bit
REFERENCE_WITH = "reference_with"  # the final state equals a clean run told to do what the guard did
# The same global batches in the same order as the clean run, on another world size: every loss equal to
# rounding (one process sums the micro-batches in another order), the tokens seen exactly equal.
CLOSE = "close"
CLOSE_RTOL = 2e-3
# Replica groups: while a group is missing the survivors sum its share of the global batch themselves, in
# another order: the final parameters and every step's loss within REPLICA_ATOL of the fault-free
# replica-group run (float32 over the steps after the fault), the tokens seen exactly equal.
REPLICAS = "replicas"
REPLICA_ATOL = 1e-4

# Network faults, on nodes that are network namespaces of their own (keel.drill.netns, needs root), one node's link
# hit: its cable pulled, then put back once the others go on alone; its link down for 5 s once; down for 2 s three
# times; its port slowed to a token bucket's rate until a straggler is named.
PULL_CABLE, FLAP_LINK, FLAPPING, SLOW_LINK = "pull_cable", "flap_link", "flapping", "slow_link"
# Three nodes of one process: a global batch that splits over 3 data-parallel ranks and over the 2 left.
THREE_NODES = ("train.global_batch=24", "train.micro_batch=4", "eval.sequences=12")

# What the drill does from outside between the first launch and the rerun.
CORRUPT_LATEST = "corrupt_latest_checkpoint"
LOSE_MANIFEST = "lose_latest_manifest"


@dataclass(frozen=True)
class Outside:
    """An action taken from outside the job: `signal` sent to the launcher once the run reached `at_step`,
    or, with `while_starting`, once every worker has started but before the first step."""

    signal: str = "SIGTERM"
    at_step: int = 0
    while_starting: bool = False
    target: str = "launcher"  # or LIGHTHOUSE: the torchft lighthouse `keel train --replica-groups` started


LIGHTHOUSE = "lighthouse"


@dataclass(frozen=True)
class Scenario:
    """One rehearsed failure.

    `config` holds overrides that shape the math (layout, guard settings): the clean reference runs with
    them too. `tuning` holds overrides that only make the detectors act within a short run (watchdog
    timeouts, check intervals): the faulted run alone gets them, so they must not change the math.
    """

    name: str
    promise: str
    inject: tuple[str, ...] = ()
    fault_step: int = 0  # the step the fault lands in (detection latency counts from here)
    config: tuple[str, ...] = ()
    tuning: tuple[str, ...] = ()
    max_restarts: int = 0
    outside: Outside | None = None
    rerun: bool = False  # after the first launch ends, run the same command again without the fault
    first_exit: int | None = None  # the exit code the first launch must end with when `rerun` (None: non-zero)
    compare: str = BITWISE
    reference_with: tuple[str, ...] = ()  # REFERENCE_WITH: overrides of the clean run to compare with
    # (kind, action[, detail]) of the event that counts as detection; "" matches any, detail must be contained
    detect: tuple = ("", "")
    recovered_by: tuple | None = ("step", "first")  # the event that ends recovery; None: immediate
    steps: int | None = None  # the run's length, when the scenario needs another than the suite's
    between: str = ""  # an action from outside after the first launch, before the rerun (CORRUPT_LATEST)
    volume: bool = False  # checkpoints on a small volume of their own (a tmpfs the drill mounts; needs root)
    nodes: int = 1  # launchers of an elastic job (--nnodes 1:N, N:N when none is lost), each with nproc // N processes
    lose_node_at: int = 0  # with nodes > 1: the step at which the last node is killed outright
    lose_nodes: int = 1  # how many nodes (the last ones) are killed then; all of them end the job
    groups: int = 1  # replica groups (`--replica-groups`, one process each); the reference has as many
    survivor: bool = True  # with groups: group 0 is never hit, keeps its process and makes no step again
    # Processes of each launch (of each replica group with `groups`) when its layout needs a number of its own;
    # 0: the drill's --nproc, or one per replica group. The reference runs on as many.
    nproc: int = 0
    network: str = ""  # with nodes > 1: the nodes are network namespaces, and this fault hits `victim`'s link
    victim: int = -1  # the node whose link the network fault hits (-1: the last; node 0 hosts the rendezvous)
    victim_exit: int = 0  # with network: the exit code the hit node's command must end with

    def with_(self, **changes: Any) -> Scenario:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Plan:
    """Where faults land in a run of `steps` steps with a checkpoint every `interval` steps."""

    steps: int = 40
    interval: int = 10
    rank: int = 1

    @property
    def mid(self) -> int:
        """A step in the middle of the last full checkpoint interval but one: work is lost on a restart."""
        return self.steps - self.interval - self.interval // 2

    @property
    def save(self) -> int:
        """A checkpoint step with an earlier checkpoint to fall back to (the last one but the final)."""
        return self.steps - self.interval


# A throughput drop stands out after a few logged intervals, and is reported within a second.
FAST_THROUGHPUT = ("monitor.interval=1", "monitor.alerts.throughput_window=5", "monitor.alerts.throughput_for_s=0.5")
# The spike guard needs a warm window before a poisoned batch stands out; these match the guard tests.
SPIKE_GUARDS = ("guard.snapshot_interval=10", "guard.rollback_steps=5", "guard.skip_batches=8",
                "guard.spike.warmup=20", "guard.spike.window=40")
FAST_WATCHDOG = ("health.watchdog.warmup_steps=5", "health.watchdog.min_timeout_s=4", "health.watchdog.poll_s=0.5")
REPLICATED = ("parallel.dp_replicate=2", "parallel.dp_shard=1")
# The scenarios that rehearse the replicas' fingerprints switch off the at-rest check, which would catch a flip in
# stored state first, at the next step (bitflip_params_sharded rehearses it).
NO_AT_REST = "guard.sdc.at_rest_interval=0"


def _poisoned(steps: int = 80, snapshot: int = 10, rollback: int = 5, skip: int = 8) -> Scenario:
    batch = steps * 5 // 8 - 1  # read by step batch + 1, after the spike window has warmed up
    to_step = (batch + 1 - rollback) // snapshot * snapshot  # the newest snapshot far enough back
    skipped = [to_step, max(to_step + skip, batch + 1)]
    return Scenario(
        "poisoned_batch", "a loss spike rolls back and skips the bad data; the result is the clean run without it",
        inject=(f"poison_batch:batch={batch}",), fault_step=batch + 1, config=SPIKE_GUARDS, compare=REFERENCE_WITH,
        reference_with=(f"data.skip_batches=[{skipped}]",), detect=("guard", "rollback"),
        recovered_by=("guard", "rolled_back"), steps=steps)


# Every group sleeps this long in each step, so that a killed group is back (process start, torchrun, heal)
# well before the run ends; the sleep changes nothing the run computes. PACE_WHILE_MISSING: only in the steps
# the live groups make without a lost one (as long as PACE would give it), at their own pace once it healed.
PACE = "slow:rank=-1,seconds=0.4"
PACE_WHILE_MISSING = f"{PACE},while_missing=true"
SURVIVOR_ALONE = ("quorum", "change", {"group": 0, "participants": 1})  # group 0 goes on without group 1
HEALED = ("quorum", "heal", {"group": 1})
REPLICA_PROMISE = ("survivors lose no step; the run ends as the fault-free replica-group run (within "
                   f"{REPLICA_ATOL:g}), the same tokens seen")


def _group_lost(plan: Plan) -> tuple[int, dict[str, Any]]:
    """The step a replica group is lost in, early (it has most of the run to come back and heal), and what
    every such scenario shares."""
    at = plan.interval // 2 + 1
    return at, dict(fault_step=at, groups=2, max_restarts=1, compare=REPLICAS, detect=SURVIVOR_ALONE,
                    recovered_by=HEALED)


def _replica_groups(plan: Plan) -> list[Scenario]:
    at, lost = _group_lost(plan)
    return [
        Scenario("group_loss", f"a replica group SIGKILLed mid-step heals from the live one; {REPLICA_PROMISE}",
                 inject=(PACE_WHILE_MISSING, f"kill:step={at},rank=-1,group=1"), **lost),
        Scenario("group_loss_in_allreduce", "a replica group SIGKILLed while its peer waits for it in the gradient "
                 f"all-reduce: that step is made again, the group heals; {REPLICA_PROMISE}",
                 inject=(PACE_WHILE_MISSING, f"kill_in_reduce:step={at},group=1"), **lost),
        Scenario("group_hang", "a replica group stopped (SIGSTOP) is left behind after the heartbeat timeout, "
                 f"restarted by its own launcher and heals; {REPLICA_PROMISE}",
                 inject=(PACE_WHILE_MISSING, f"signal:step={at},rank=-1,group=1,signal=SIGSTOP"), tuning=FAST_WATCHDOG,
                 **lost),
        Scenario("flapping_group", "a replica group killed again in its first step after it healed heals a "
                 f"second time; {REPLICA_PROMISE}",
                 inject=("slow:rank=-1,seconds=0.8", f"kill:step={at},rank=-1,group=1", "kill_rejoined:group=1"),
                 **{**lost, "max_restarts": 2}),
        Scenario("lighthouse_restart", "a SIGKILLed lighthouse is started again on its port; the groups keep "
                 f"their processes and reconnect; {REPLICA_PROMISE}",
                 inject=(PACE,), outside=Outside("SIGKILL", at_step=at, target=LIGHTHOUSE),
                 **{**lost, "detect": ("lighthouse", "restarted"), "recovered_by": None}),
        Scenario("rejoin_killed_lighthouse", "a replica group SIGKILLed, its new worker SIGKILLed again while it "
                 "joins and the lighthouse a second later: no wait outlives its timeout, the group heals; "
                 f"{REPLICA_PROMISE}",
                 inject=(PACE_WHILE_MISSING, f"kill:step={at},rank=-1,group=1",
                         "kill_joining:group=1,after_s=0.2,lighthouse_after_s=1"), **{**lost, "max_restarts": 2}),
        Scenario("group_killed_in_heal", "a replica group SIGKILLed, then again as it heals (the live state "
                 "received): the survivors notice within the heartbeat timeout, the group heals at its next start; "
                 f"{REPLICA_PROMISE}",
                 inject=(PACE_WHILE_MISSING, f"kill:step={at},rank=-1,group=1", "kill_healing:group=1"),
                 **{**lost, "max_restarts": 2}),
        Scenario("lighthouse_killed_in_heal", "the lighthouse SIGKILLed while a healed group's state is handed "
                 f"over: the transfer completes, the lighthouse is started again, the groups train on; "
                 f"{REPLICA_PROMISE}",
                 inject=(PACE_WHILE_MISSING, f"kill:step={at},rank=-1,group=1", "kill_lighthouse_serving:group=0"),
                 **lost),
        Scenario("both_groups_killed", "every replica group SIGKILLed within a second: each is restarted, the first "
                 "quorum holds both again and resumes from the newest checkpoint; the run ends as the fault-free "
                 f"replica-group run (within {REPLICA_ATOL:g}), the same tokens seen",
                 inject=(f"kill:step={at},rank=-1,group=0", f"kill:step={at},rank=-1,group=1"),
                 **{**lost, "survivor": False, "detect": ("failure", "restart"),
                    "recovered_by": ("quorum", "change", {"group": 0, "participants": 2})}),
    ]


# The config's model made a mixture of experts: four routed experts, two per token, the first block dense, the
# experts split over two expert-parallel ranks (borrowed from the data-parallel ones), their selection biases
# moving with the loads (restored by a restart and a rollback, since they change the routing). Replica groups
# sum the loads within a group only, so there the biases stay still.
MOE_MODEL = ("model.moe.experts=4", "model.moe.top_k=2", "model.moe.dense_layers=1", "parallel.ep=2")
MOE = (*MOE_MODEL, "model.moe.bias_update_rate=0.01")
# Micro-batches of 2 sequences, so that a small global batch still splits over 4 data-parallel ranks (2 replica
# groups of 2, or 2 HSDP replicas of 2).
SPLIT_4 = "train.micro_batch=2"
MOE_GROUPS = (*MOE_MODEL, "model.moe.bias_update_rate=0", SPLIT_4)
# The expert weights of the mixture block, 3-D with the experts first, split along them over the expert ranks:
# element 5 of a rank's shard belongs to its first local expert (rank 1 of ep = 2 holds experts 2 and 3 of 4).
EXPERT_W1, EXPERT_W2 = "layers.1.moe.experts.w1", "layers.1.moe.experts.w2"
# Two HSDP replicas, each an expert-parallel pair (4 processes): every expert shard has a replica to compare with.
HSDP_EP = ("parallel.dp_replicate=2", "parallel.dp_shard=2", SPLIT_4)


def _moe(plan: Plan) -> list[Scenario]:
    """Recovery on a mixture-of-experts model with expert parallelism: a restart, the SDC guards on an expert
    shard (replicas compare it where there are any; replay sees gradients everywhere), a replica group healed."""
    mid, r = plan.mid, plan.rank
    at, lost = _group_lost(plan)
    return [
        Scenario("moe_kill_mid_step", "experts split over 2 ranks (ep = 2): a rank SIGKILLed mid-step is restarted "
                 "and the run ends bitwise equal, the selection biases with it",
                 inject=(f"kill:step={mid},rank={r}",), fault_step=mid, config=MOE, max_restarts=1,
                 detect=("failure", "")),
        Scenario("moe_bitflip_expert", "ep = 2 within each of 2 HSDP replicas (4 processes), the at-rest check "
                 "off: a flipped bit in one expert's weights on rank 1 is caught by the replicas' fingerprints, "
                 "rolled back, re-executed and rank 1 named; the run ends bitwise equal",
                 inject=(f"bitflip:step={mid},rank={r},target=params,name={EXPERT_W1},element=5,bit=22",),
                 fault_step=mid, config=(*MOE, *HSDP_EP), nproc=4,
                 tuning=(f"guard.sdc.fingerprint_interval={plan.interval}", NO_AT_REST), detect=("guard", "rollback"),
                 recovered_by=("guard", "quarantine", {"ranks": [r]})),
        Scenario("moe_bitflip_expert_grads", "ep = 2 (no replica of an expert shard): a flipped bit in one "
                 "expert's gradients on rank 1 is caught by replay in its step and the run ends bitwise equal",
                 inject=(f"bitflip:step={mid},rank={r},target=grads,name={EXPERT_W2},element=5,bit=20",),
                 fault_step=mid, config=MOE, tuning=(f"guard.sdc.replay_interval={plan.interval // 2}",),
                 detect=("guard", "quarantine"), recovered_by=("guard", "rolled_back")),
        Scenario("moe_group_loss", "2 replica groups, each ep = 2 on 2 processes: a group SIGKILLed mid-step heals "
                 f"its expert shards from the live one; {REPLICA_PROMISE}",
                 inject=(PACE_WHILE_MISSING, f"kill:step={at},rank=-1,group=1"), config=MOE_GROUPS, nproc=2,
                 **lost),
    ]


def _network(plan: Plan) -> list[Scenario]:
    """Faults of the network between nodes, each node a network namespace with its own address and link."""
    mid = plan.mid
    # The step timeout learned early; one-second steps from the fault on, so that the nodes left are still
    # training when a node is back (or has left for good).
    paced: dict[str, Any] = dict(tuning=("health.watchdog.warmup_steps=5",), inject=(
        "slow:rank=-1,seconds=0.1", f"slow:rank=-1,seconds=0.9,from_step={mid + 1}"))
    return [
        Scenario("cable_pulled", "the cable of one of three nodes pulled mid-run: it leaves the job, the others name "
                 "it within the learned timeout and go on from the last checkpoint on two nodes; with the cable back "
                 "it rejoins, and the run ends with the same global batches in the same order", nodes=3, nproc=3,
                 config=THREE_NODES, network=PULL_CABLE, fault_step=mid, max_restarts=2, compare=CLOSE,
                 detect=("leave", "cut_off"), recovered_by=("resume", ""), **paced),
        Scenario("rendezvous_cable_pulled", "the cable of the node hosting the rendezvous pulled mid-run: the "
                 "other node leaves saying its own link is up, the host names itself (its link down) and goes on "
                 "alone from the last checkpoint; with the cable back the other rejoins, and the run ends with the "
                 "same global batches in the same order", nodes=2, network=PULL_CABLE, victim=0, fault_step=mid,
                 max_restarts=2, compare=CLOSE, detect=("hang", "", {"hosts": ["node-0"]}),
                 recovered_by=("resume", ""), **paced),
        Scenario("link_flap", "a node's link down for 5 s: the job waits it out, an alert names the node and its "
                 "interface, no node is quarantined for one flap, and the run ends bitwise equal", nodes=2,
                 network=FLAP_LINK, fault_step=mid, tuning=("monitor.telemetry_interval_s=0.5",),
                 inject=("slow:rank=-1,seconds=0.1",), detect=("alert", "link_flapped"), recovered_by=None),
        Scenario("link_flapping", "a node's link down for 2 s three times in a row: an alert names it, the node "
                 "lists itself in quarantine.json (health.flap_limit) and leaves, and the other goes on from the last "
                 "checkpoint with the same global batches in the same order", nodes=2, network=FLAPPING,
                 fault_step=mid, max_restarts=2, compare=CLOSE, victim_exit=EXIT_QUARANTINE,
                 detect=("leave", "flapping"), recovered_by=("resume", ""),
                 **{**paced, "tuning": (*paced["tuning"], "monitor.telemetry_interval_s=0.5")}),
        Scenario("group_cable_pulled", "the cable of one replica group's node pulled mid-run: the other group goes "
                 "on without it and never restarts, the lost group heals from it once the cable is back; "
                 f"{REPLICA_PROMISE}", network=PULL_CABLE, inject=(PACE_WHILE_MISSING,),
                 tuning=("fault_tolerance.timeout_s=10",), **{**_group_lost(plan)[1], "max_restarts": 3}),
        Scenario("slow_link", "one of three nodes' ports slowed to 50 Mbit/s: the node is named a straggler by its "
                 "link probe, its neighbours are not, and the run ends bitwise equal", nodes=3, nproc=3,
                 network=SLOW_LINK, fault_step=plan.interval, config=THREE_NODES,
                 tuning=("health.straggler.interval=5",), inject=("slow:rank=-1,seconds=0.1",),
                 detect=("straggler", "", {"link": True, "node": "node-2"}), recovered_by=None),
    ]


def catalog(plan: Plan = Plan()) -> dict[str, Scenario]:
    """Every scenario, keyed by name, with its faults placed for `plan`."""
    mid, save, r = plan.mid, plan.save, plan.rank
    scenarios = [
        Scenario("kill_mid_step", "a rank SIGKILLed mid-step is restarted and the run ends bitwise equal",
                 inject=(f"kill:step={mid},rank={r}",), fault_step=mid, max_restarts=1, detect=("failure", "")),
        Scenario("kill_restored_from_memory", "with the state also held in memory every 2 steps, a rank SIGKILLed "
                 "mid-step is restarted from the newest copy in memory, reading no storage, and the run ends bitwise "
                 "equal", inject=(f"kill:step={mid},rank={r}",), fault_step=mid, max_restarts=1,
                 tuning=("checkpoint.memory_interval=2",), detect=("failure", ""),
                 recovered_by=("memory", "restored")),
        Scenario("kill_restarted_in_process", "with the state also held in memory every 2 steps and in-process "
                 "restarts on, a rank SIGKILLed mid-step is restarted alone while the others keep their processes; "
                 "all restore the newest copy in memory and the run ends bitwise equal",
                 inject=(f"kill:step={mid},rank={r}",), fault_step=mid, max_restarts=1,
                 tuning=("checkpoint.memory_interval=2", "health.in_process_restart=true"),
                 detect=("failure", "in_process"), recovered_by=("memory", "restored")),
        Scenario("kill_during_save", "a SIGKILL during a background checkpoint write loses no committed state; "
                 "the rerun resumes from the previous checkpoint and ends bitwise equal",
                 inject=(f"sigkill_during_checkpoint_write:step={save},rank={r}",), fault_step=save, rerun=True,
                 detect=("failure", "")),
        Scenario("hang", "a hung rank is found within the learned timeout, restarted, and the run ends bitwise equal",
                 inject=(f"hang:step={mid},rank={r}",), fault_step=mid, tuning=FAST_WATCHDOG, max_restarts=1,
                 detect=("hang", "")),
        Scenario("stopped_rank0", "a stopped (SIGSTOP) rank 0, which hosts the store, is named by its launcher "
                 "within the learned timeout, restarted, and the run ends bitwise equal",
                 inject=(f"signal:step={mid},rank=0,signal=SIGSTOP",), fault_step=mid, tuning=FAST_WATCHDOG,
                 max_restarts=1, detect=("hang", "")),
        Scenario("straggler", "a rank 3x slower is named and the math is untouched",
                 inject=(f"slow:rank={r},factor=3",), fault_step=1,
                 tuning=(f"health.straggler.interval={max(plan.interval // 2, 5)}",),
                 detect=("straggler", ""), recovered_by=None),
        Scenario("nan_grads", "a NaN in one rank's gradients skips that update on every rank and nothing else",
                 inject=(f"nan_grads:step={mid},rank={r}",), fault_step=mid, compare=REFERENCE_WITH,
                 reference_with=(f'drill.inject=["skip_update:step={mid}"]',), detect=("guard", "skip"),
                 recovered_by=None),
        _poisoned(),
        Scenario("bitflip_params_sharded", "FSDP, no replica: a flipped bit in one rank's parameter shard is caught "
                 "by its own at-rest check before the next update, the rank and the tensor named, rolled back; the "
                 "run ends bitwise equal",
                 inject=(f"bitflip:step={mid},rank={r},target=params,tensor=3,element=5,bit=0",), fault_step=mid,
                 detect=("guard", "quarantine"), recovered_by=("guard", "rolled_back")),
        Scenario("bitflip_params_replicated", "the at-rest check off: a flipped bit in one replica's parameters is "
                 "caught by fingerprints, rolled back and re-executed; the run ends bitwise equal",
                 inject=(f"bitflip:step={mid},rank={r},target=params,tensor=3,element=5,bit=22",), fault_step=mid,
                 config=REPLICATED, tuning=(f"guard.sdc.fingerprint_interval={plan.interval}", NO_AT_REST),
                 detect=("guard", "rollback"), recovered_by=("guard", "rolled_back")),
        Scenario("bitflip_grads", "a flipped bit in one rank's gradients is caught by replay in its step and the "
                 "run ends bitwise equal",
                 inject=(f"bitflip:step={mid},rank={r},target=grads,tensor=3,element=5,bit=20",), fault_step=mid,
                 tuning=(f"guard.sdc.replay_interval={plan.interval // 2}",),
                 detect=("guard", "quarantine"), recovered_by=("guard", "rolled_back")),
        Scenario("bitflip_optimizer", "the at-rest check off: a flipped exponent bit in one replica's Adam moment is "
                 "caught and rolled back; the run ends bitwise equal",
                 inject=(f"bitflip:step={mid},rank={r},target=exp_avg,tensor=2,element=0,bit=30",), fault_step=mid,
                 config=REPLICATED, tuning=(f"guard.sdc.fingerprint_interval={plan.interval}", NO_AT_REST),
                 detect=("guard", ""), recovered_by=("guard", "rolled_back")),
        Scenario("preemption", "SIGTERM to the launcher checkpoints, exits 75, and the rerun ends bitwise equal",
                 inject=("slow:rank=-1,seconds=0.1",), outside=Outside("SIGTERM", at_step=plan.interval),
                 fault_step=plan.interval, rerun=True, first_exit=75, detect=("pause", "")),
        Scenario("corrupt_checkpoint", "a corrupted latest checkpoint is found on resume and skipped; the run resumes "
                 "from the previous one and ends bitwise equal",
                 inject=(f"sigkill_after_checkpoint:step={save},rank={r}",), fault_step=save, rerun=True,
                 between=CORRUPT_LATEST, detect=("checkpoint", "skipped"), recovered_by=("resume", "")),
        Scenario("launcher_killed", "a SIGKILLed launcher takes its workers with it; the rerun resumes from the last "
                 "checkpoint and ends bitwise equal",
                 inject=("slow:rank=-1,seconds=0.1",), outside=Outside("SIGKILL", at_step=mid), fault_step=mid,
                 rerun=True, first_exit=-9, detect=("resume", "")),
        Scenario("stop_while_starting", "SIGTERM to the launcher while the workers start is a pause (exit 75) with "
                 "nothing trained or lost; the rerun ends bitwise equal",
                 outside=Outside("SIGTERM", while_starting=True), fault_step=1, rerun=True, first_exit=75,
                 detect=("pause", "")),
        Scenario("manifest_lost", "a checkpoint whose manifest is lost is set aside, never deleted; the run resumes "
                 "from the previous one and ends bitwise equal",
                 inject=(f"sigkill_after_checkpoint:step={save},rank={r}",), fault_step=save, rerun=True,
                 between=LOSE_MANIFEST, detect=("checkpoint", "set_aside"), recovered_by=("resume", "")),
        Scenario("volume_read_only", "a checkpoint volume remounted read-only fails that save with a plain event; "
                 "training goes on, the next save succeeds, the run ends bitwise equal",
                 inject=(f"read_only_before_checkpoint:step={save},path={{volume}}",), fault_step=save, volume=True,
                 detect=("checkpoint", "failed"), recovered_by=("checkpoint", "committed")),
        Scenario("disk_full", "ENOSPC during a save loses nothing, the next save succeeds, the run ends bitwise equal",
                 inject=(f"fill_disk_before_checkpoint:step={save},path={{volume}}",), fault_step=save, volume=True,
                 detect=("checkpoint", "failed"), recovered_by=("checkpoint", "committed")),
        Scenario("node_loss", "a node killed outright is dropped from the elastic job; the other resumes from the "
                 "last checkpoint with the same global batches in the same order", fault_step=mid, nodes=2,
                 lose_node_at=mid, max_restarts=1, compare=CLOSE, detect=("failure", "")),
        Scenario("kill_during_memory_save", "with the state held in memory every 2 steps on two nodes, a rank "
                 "SIGKILLed while its memory copy is written, before it reaches its buddy node: that step is never "
                 "published, the restarted job restores the step before it from memory, reading no storage, and ends "
                 "bitwise equal", nodes=2, fault_step=mid + mid % 2, max_restarts=1,
                 inject=(f"sigkill_during_checkpoint_write:step={mid + mid % 2},rank=1,times=1,tier=memory",),
                 tuning=("checkpoint.memory_interval=2",), detect=("failure", ""),
                 recovered_by=("memory", "restored")),
        Scenario("node_loss_restored_from_memory", "with the state also held in memory every 2 steps, each node's "
                 "copy holding its buddy's files too, a node killed outright is dropped from the elastic job; the "
                 "other restores the newest step from its own memory, the lost node's files included, reading no "
                 "storage, and goes on with the same global batches in the same order", fault_step=mid, nodes=2,
                 lose_node_at=mid, max_restarts=1, compare=CLOSE, tuning=("checkpoint.memory_interval=2",),
                 detect=("failure", ""), recovered_by=("memory", "restored")),
        Scenario("node_and_buddy_lost", "with the state also held in memory every 2 steps, a node and its buddy "
                 "(both nodes of the job) killed outright, their memory with them: the job started again finds no "
                 "copy in memory, resumes from the newest storage checkpoint and goes on with the same global "
                 "batches in the same order", nodes=2, fault_step=mid, lose_node_at=mid, lose_nodes=2, max_restarts=1,
                 rerun=True, first_exit=-9, compare=CLOSE,
                 tuning=("checkpoint.memory_interval=2",), detect=("resume", "", {"tier": "storage"}),
                 recovered_by=("step", "first")),
        Scenario("slow_collective", "a rank whose collectives are delayed is reported and the math is untouched",
                 inject=(f"slow_collective:rank={r},seconds=0.05,from_step={plan.interval}",),
                 fault_step=plan.interval, tuning=FAST_THROUGHPUT, detect=("alert", "throughput_drop"),
                 recovered_by=None),
        *_replica_groups(plan),
        *_moe(plan),
        *_network(plan),
    ]
    return {s.name: s for s in scenarios}


# The quick suite: one scenario of each way recovery works (restart, rerun, rollback, skip, replay, a replica
# group healing from a live one), on a model and batch small enough that each run takes seconds.
QUICK = ["kill_mid_step", "kill_during_save", "hang", "nan_grads", "bitflip_grads", "bitflip_params_sharded",
         "preemption", "corrupt_checkpoint", "kill_during_memory_save", "node_loss_restored_from_memory",
         "group_loss"]
QUICK_SHAPE = ("model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=64",
               "train.seq_len=64", "train.global_batch=8", "train.micro_batch=4", "eval.interval=0",
               "monitor.interval=5", "health.preflight_probe_mib=4")


# The mixture-of-experts suite: a restart, an expert shard's flipped bit seen by replicas and by replay, and a
# replica group healed, each on the config's model made a mixture of experts split over 2 ranks.
MOE_SUITE = ["moe_kill_mid_step", "moe_bitflip_expert", "moe_bitflip_expert_grads", "moe_group_loss"]
# The network suite: faults of the links between nodes made of network namespaces (root only).
NETWORK_SUITE = ["cable_pulled", "rendezvous_cable_pulled", "link_flap", "link_flapping", "group_cable_pulled",
                 "slow_link"]
SUITES = {"quick": QUICK, "moe": MOE_SUITE, "network": NETWORK_SUITE}


def suite(name: str, plan: Plan) -> list[Scenario]:
    """The scenarios of suite `name` (quick, moe, full: every one), faults placed for `plan`."""
    scenarios = catalog(plan)
    return [scenarios[n] for n in SUITES[name]] if name in SUITES else list(scenarios.values())
