"""Attention within documents (`data.document_mask`): a sequence packing several documents computes, for each
document, what that document computes alone, to fp32 rounding, with or without positions restarted per document;
without the mask the documents see each other."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from keel.config import load_config
from keel.errors import ConfigError
from keel.model.init import init_weights
from keel.model.llama import Llama

BOS, EOS = 256, 257
SHAPE = ["model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=2", "model.max_seq_len=64",
         "train.seq_len=64"]


def documents(lengths: tuple[int, ...]) -> list[torch.Tensor]:
    """Documents as the corpus frames them: BOS, byte ids, EOS."""
    g = torch.Generator().manual_seed(0)
    return [torch.cat([torch.tensor([BOS]), torch.randint(0, 256, (n,), generator=g), torch.tensor([EOS])])
            for n in lengths]


@pytest.fixture(scope="module")
def model() -> Llama:
    m = Llama(load_config(None, SHAPE).model)
    init_weights(m, 0)
    return m


def losses(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:-1], tokens[1:], reduction="none")


@pytest.mark.parametrize("positions", [False, True], ids=["rope_continues", "rope_restarts"])
def test_a_packed_sequence_computes_each_document_as_if_alone(model: Llama, positions: bool) -> None:
    docs = documents((9, 20, 14, 13))
    packed = torch.cat(docs)
    with torch.no_grad():
        alone = [model(d[None])[0] for d in docs]
        model.mask_documents(BOS, positions)
        try:
            masked = model(packed[None])[0]
        finally:
            model.document_start = None
        unmasked = model(packed[None])[0]
    torch.testing.assert_close(masked, torch.cat(alone), rtol=0, atol=1e-5)
    # The loss of every prediction within a document, packed, is that document's own, to fp32 rounding.
    start = 0
    for doc, logits in zip(docs, alone, strict=True):
        end = start + len(doc)
        packed_loss, own = losses(masked[start:end], doc), losses(logits, doc)
        torch.testing.assert_close(packed_loss, own, rtol=0, atol=1e-5)
        assert abs(packed_loss.mean().item() / own.mean().item() - 1) < 1e-6
        start = end
    later = slice(len(docs[0]), None)  # past the first document, plain causal attention sees the earlier ones
    assert (unmasked[later] - torch.cat(alone)[later]).abs().max() > 1e-2


def test_tokens_before_the_first_document_start_are_a_document_of_their_own(model: Llama) -> None:
    tail, doc = documents((30,))[0][10:], documents((12,))[0]  # the end of a document cut by the sequence
    with torch.no_grad():
        alone = torch.cat([model(tail[None])[0], model(doc[None])[0]])
        model.mask_documents(BOS, True)
        try:
            masked = model(torch.cat([tail, doc])[None])[0]
        finally:
            model.document_start = None
    torch.testing.assert_close(masked, alone, rtol=0, atol=1e-5)


def test_positions_per_document_without_the_mask_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="needs data.document_mask = true") as e:
        load_config(None, ["data.document_positions=true"])
    assert "\n" not in str(e.value)
