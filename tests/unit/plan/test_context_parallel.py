"""Context parallelism in the planner: a sequence split over cp ranks divides every per-token activation by cp,
adds the gathered K/V of one block and the exchange that gathers it, shards the state over dp_shard × cp, and
is searched where sequences are long or nothing fits without it."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keel.config import ModelConfig, load_config
from keel.core.accelerators import by_key
from keel.errors import KeelError
from keel.plan.layout import Layout, Workload, config_layout, parse_layout
from keel.plan.layouts import CP_MIN_SEQ, assess, explain, search
from keel.plan.memory import GIB, block_activations, cp_kv_buffer, memory, suggest
from keel.plan.report import Question, answer, lines
from keel.plan.throughput import DEFAULT, Efficiency, _link, collective, cp_exchange, cp_kv_bytes, step_time
from tests.conftest import REPO

H100 = by_key("h100")
EXACT = Efficiency(compute=1.0, overlap=0.0, link=1.0)
MIB = 2**20


@cache
def model(name: str) -> ModelConfig:
    return load_config(REPO / "configs" / f"{name}.toml", []).model


def long_context(seq: int, batch: int = 32) -> Workload:
    return Workload(model("llama3_8b"), seq, batch)


def test_a_layout_string_takes_cp_and_the_layout_names_it() -> None:
    layout = parse_layout("tp=2,cp=4", 64)
    assert layout == Layout(tp=2, cp=4, dp_shard=8) and layout.gpus() == 64
    assert layout.dp() == 8 and layout.shard() == 32  # the batch splits over dp; the state over dp_shard × cp
    assert layout.describe() == "tp2 cp4 dp_shard8 mb1"
    assert "cp=4" in layout.spec() and parse_layout(layout.spec(), 64) == layout
    assert "cp" not in Layout(tp=2, dp_shard=4).describe()
    with pytest.raises(KeelError, match=r"tp × pp × dp_replicate × cp = 128 does not divide --gpus 64"):
        parse_layout("tp=8,cp=16", 64)
    with pytest.raises(KeelError, match=r"uses 32 devices \(tp × pp × dp_shard × dp_replicate × cp\), not --gpus 64"):
        parse_layout("cp=4,dp_shard=8", 64)
    with pytest.raises(KeelError, match="cp=0: expected a positive whole number"):
        parse_layout("cp=0", 64)


def test_a_config_s_parallel_cp_is_the_given_layout_s() -> None:
    cfg = load_config(REPO / "configs" / "llama3_8b.toml", ["parallel.tp=2"])
    assert config_layout(cfg, 64)[0] == Layout(tp=2, dp_shard=32)  # no parallel.cp: none
    cfg.parallel.cp = 4  # type: ignore[attr-defined]  # what parallel.cp = 4 gives
    assert config_layout(cfg, 64)[0] == Layout(tp=2, cp=4, dp_shard=8)


def test_cp_divides_every_per_token_activation_of_a_16k_sequence() -> None:
    """8B at 16,384 tokens: what a rank keeps for the backward pass and the loss's buffers fall to exactly 1/cp;
    the state, sharded over dp_shard × cp, is that of FSDP over the same ranks."""
    work = long_context(16_384, batch=64)
    for ac in ("none", "selective", "full"):
        one, four = (memory(work, Layout(dp_shard=8 // cp, cp=cp, ac=ac), H100) for cp in (1, 4))
        assert four.activations == pytest.approx(one.activations / 4, rel=1e-12)
        assert (four.params, four.grads, four.optimizer) == (one.params, one.grads, one.optimizer)
    # The loss's buffers (12 bytes per logit) are the backward pass's transient at both: 1/4 of the logits.
    one, four = (memory(work, Layout(dp_shard=2, cp=cp), H100) for cp in (1, 4))
    assert one.backward == pytest.approx(16_384 * 128_256 * 12) and four.backward == pytest.approx(one.backward / 4)
    assert four.params == pytest.approx(one.params / 4)  # 8 ranks shard what 2 did
    per_token = (four.activations + four.backward) / (one.activations + one.backward)
    assert per_token == pytest.approx(0.25, rel=1e-9)


def test_a_block_s_backward_holds_the_gathered_k_and_v_and_their_gradients() -> None:
    """8B: 8 KV heads of 128. At 16,384 tokens the full sequence's K and V are 2 × 16,384 × 8 × 128 bf16
    elements, 64 MiB, and their gradients as much; tp splits the heads; nothing is kept for the backward."""
    # A smaller vocabulary and the fused loss: a block's backward, not the loss, is the backward pass's peak.
    work = Workload(replace(model("llama3_8b"), vocab_size=32_000), 16_384, 64, cross_entropy="fused")
    assert cp_kv_buffer(work, Layout(cp=4)) == 128 * MIB
    assert cp_kv_buffer(work, Layout(cp=4, tp=2, micro_batch=2)) == 128 * MIB
    assert cp_kv_buffer(work, Layout()) == 0
    for ac, factor in (("none", 1), ("full", 2)):
        layout = Layout(cp=4, dp_shard=2, ac=ac)
        full, _ = block_activations(work, 1, tp=1, sp=True, cp=4)
        assert memory(work, layout, H100).backward == pytest.approx(factor * full + 128 * MIB)


def test_a_short_sequence_is_not_told_to_use_cp() -> None:
    """CP would make this 70B layout fit at 8,192 tokens (its sharding grows to 4 ranks), but below CP_MIN_SEQ
    the suggestion keeps to what the search would choose from."""
    work = Workload(model("llama3_70b"), 8192, 64, cross_entropy="fused")
    layout = Layout(tp=4, dp_shard=2, dp_replicate=2, micro_batch=4, ac="full")
    assert memory(work, Layout(tp=4, cp=4, micro_batch=4, ac="full"), H100).fits
    assert suggest(work, layout, H100).endswith("; try tp=8 pp=2 dp_shard=1 dp_replicate=1 micro_batch=1")


# One pipeline rank: with several, the breakdown is the fuller rank's, which CP may change.
LAYOUTS = st.builds(Layout, tp=st.sampled_from([1, 2, 4, 8]), dp_shard=st.sampled_from([1, 2, 8]),
                    dp_replicate=st.sampled_from([1, 2]), micro_batch=st.integers(1, 4),
                    ac=st.sampled_from(["none", "selective", "full"]), sp=st.booleans())


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["llama3_8b", "llama3_70b"]), LAYOUTS, st.sampled_from([16_384, 65_536, 131_072]),
       st.sampled_from([2, 4, 8, 16]))
def test_cp_divides_what_every_layout_keeps_per_token(name: str, layout: Layout, seq: int, cp: int) -> None:
    work = Workload(model(name), seq, 4096)
    one, split = memory(work, layout, H100), memory(work, replace(layout, cp=cp), H100)
    assert split.activations == pytest.approx(one.activations / cp, rel=1e-9)
    assert split.optimizer == pytest.approx(one.optimizer / cp, rel=1e-9)


def test_the_exchange_gathers_k_and_v_each_way_and_reduces_their_gradients() -> None:
    """Per block and sequence, each rank receives (cp−1)/cp of 2 · s · n_kv_heads · head_dim elements in the
    forward all-gather, as much in the backward's and in each recomputed forward's, and in the reduce-scatter
    of the gradients."""
    work = long_context(16_384, batch=64)
    layout = Layout(cp=4, dp_shard=2)  # 8 ranks, 32 micro-batches of one sequence each
    assert cp_kv_bytes(work, layout) == 64 * MIB
    per_block = 3 / 4 * 64 * MIB
    assert cp_exchange(work, layout) == pytest.approx(32 * 32 * 3 * per_block)
    assert cp_exchange(work, replace(layout, ac="full")) == pytest.approx(32 * 32 * 4 * per_block)
    assert cp_exchange(work, replace(layout, tp=2)) == pytest.approx(32 * 32 * 3 * per_block / 2)  # tp splits heads
    assert cp_exchange(work, Layout(dp_shard=8)) == 0.0


@pytest.mark.parametrize(("tp", "cp", "inside"), [(2, 4, True), (1, 8, True), (4, 4, False), (8, 2, False)])
def test_the_exchange_runs_over_nvlink_while_tp_times_cp_fits_a_node(tp: int, cp: int, inside: bool) -> None:
    work = long_context(131_072, batch=8)
    layout = Layout(tp=tp, cp=cp, dp_shard=64 // (tp * cp))
    link = _link(H100, tp, cp, EXACT)
    assert link.bandwidth == (H100.intra_bw if inside else H100.inter_bw)
    kv = cp_kv_bytes(work, layout)
    one = 2 * collective("all_gather", kv, cp, link) + collective("reduce_scatter", kv, cp, link)
    step = step_time(work, layout, H100, EXACT)
    assert step.cp_comm == pytest.approx(32 * work.micro_batches(layout) * one)
    # never hidden: it adds to the step as TP's collectives do
    assert step.total == pytest.approx(step.compute + step.tp_comm + step.cp_comm + step.fsdp_comm + step.dp_comm)
    assert sum(step.parts().values()) == pytest.approx(step.total)


def test_cp_splits_each_rank_s_tokens_and_the_state_over_dp_shard_times_cp() -> None:
    """Four CP ranks with micro-batches of four sequences compute what four FSDP ranks with one each do, and the
    sharding group spans the same eight ranks: the same compute and FSDP traffic per step."""
    work = long_context(16_384, batch=64)
    cp, fsdp = Layout(cp=4, dp_shard=2, micro_batch=4), Layout(dp_shard=8, micro_batch=1)
    a, b = step_time(work, cp, H100), step_time(work, fsdp, H100)
    assert work.micro_batches(cp) == work.micro_batches(fsdp) == 8
    assert a.compute == pytest.approx(b.compute) and a.fsdp_comm == pytest.approx(b.fsdp_comm)
    assert a.tokens_per_s_per_device * a.total * 8 == pytest.approx(64 * 16_384)
    assert a.cp_comm > 0 == b.cp_comm and a.total > b.total


def test_a_given_cp_that_does_not_split_the_sequence_is_refused() -> None:
    work = long_context(16_384 + 8, batch=8)  # 16,392 = 8 × 2,049: two chunks per rank need cp | 8,196
    candidates = search(long_context(16_384, batch=8), 8, H100)
    with pytest.raises(KeelError, match=r"cp = 8 must split the sequence \(16392\) into 2 × cp = 16 equal chunks"):
        assess(work, Layout(cp=8), H100, DEFAULT, candidates)
    with pytest.raises(KeelError, match="tokens divisible by tp = 8"):
        assess(long_context(48, batch=8), Layout(tp=8, cp=8, dp_shard=1), H100, DEFAULT, candidates)


def test_the_search_tries_cp_only_for_long_sequences_with_the_chunks_it_needs() -> None:
    short = search(Workload(model("llama3_8b"), 8192, 64), 64, H100)
    assert all(c.layout.cp == 1 for c in short)
    long = search(long_context(CP_MIN_SEQ, batch=8), 64, H100)
    assert {c.layout.cp for c in long} == {1, 2, 4, 8, 16, 32, 64}
    for c in long:
        lay = c.layout
        assert lay.gpus() == 64 and CP_MIN_SEQ % (2 * lay.cp) == 0 and (CP_MIN_SEQ // lay.cp) % lay.tp == 0
        assert 8 % lay.dp() == 0  # the batch splits over dp only


def test_a_short_sequence_that_fits_only_with_cp_is_searched_with_it() -> None:
    """Below CP_MIN_SEQ context parallelism is searched when nothing fits without it: on a device between the
    smallest layout with CP and the smallest without, the answer has CP."""
    work = Workload(model("llama3_8b"), 8192, 8)
    roomy = search(work, 64, replace(H100, memory_bytes=10**15))
    without = min(c.memory.reserved for c in roomy if c.layout.cp == 1)
    assert all(c.layout.cp == 1 for c in roomy)  # everything fits: no CP searched
    capacity = without + GIB - MIB  # usable: the capacity less the 1 GiB runtime, a MiB short of `without`
    found = search(work, 64, replace(H100, memory_bytes=capacity))
    fitting = [c for c in found if c.fits]
    assert fitting and all(c.layout.cp > 1 for c in fitting)
    assert not any(c.fits for c in found if c.layout.cp == 1)


def test_llama3_8b_at_128k_on_64_h100_is_planned_with_cp() -> None:
    """8B at 131,072 tokens, 32 sequences a step on 64 H100: without CP only tp = 8 with full checkpointing fits
    (the loss's buffers alone hold 31 GiB on TP's vocabulary shards); the best layout splits the sequence and
    skips the recompute."""
    found = search(long_context(131_072), 64, H100)
    best = next(c for c in found if c.fits)
    assert best.layout.cp > 1 and best.layout.ac != "full"
    no_cp = [c for c in found if c.fits and c.layout.cp == 1]
    assert no_cp and all(c.layout.tp == 8 and c.layout.ac == "full" for c in no_cp)
    assert best.tokens_per_s > 1.1 * no_cp[0].tokens_per_s
    text = "\n".join(explain(found))
    assert f"best: {best.layout.describe()}" in text and "without context parallelism: best is tp8" in text
    assert "FSDP only: no such layout" in text  # 64-way data parallelism does not divide 32 sequences


def test_llama3_8b_at_256k_fits_64_h100_only_with_cp_and_keel_plan_says_so() -> None:
    cfg = load_config(REPO / "configs" / "llama3_8b.toml",
                      ["train.seq_len=262144", "model.max_seq_len=262144", "train.global_batch=16"])
    work = Workload.of(cfg)
    found = search(work, 64, H100)
    assert not any(c.fits for c in found if c.layout.cp == 1)
    # a given layout without CP is told the change that fits: half its sharding turned into CP
    assert suggest(work, Layout(tp=8, dp_shard=8, ac="full"), H100).endswith("dp_shard=4 cp=2")
    a = answer(Question(cfg, 64, "h100", 1e11, spares=0, trials=50))
    best = a["layouts"][0]
    assert best["cp"] > 1 and best["tp"] * best["pp"] * best["cp"] * best["dp_shard"] * best["dp_replicate"] == 64
    assert a["step"]["cp_comm"] > 0
    assert any(line.startswith(f"best: {best['layout']}") and f"cp{best['cp']}" in line for line in lines(a))
