"""keel's lm-eval adapter on a model in this process: a continuation longer than the model's context is refused in
one line (as lm-eval's Hugging Face model refuses it), and one that fits is scored with the model's
log-probabilities."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from keel.config import ModelConfig
from keel.data.tokenizer import ByteTokenizer
from keel.errors import ConfigError
from keel.model.init import init_weights
from keel.model.llama import Llama

CONTEXT = 16


def test_a_continuation_longer_than_the_context_is_refused_and_one_that_fits_is_scored() -> None:
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from keel.downstream.adapter import KeelLM
    from keel.downstream.scoring import Scorer

    torch.manual_seed(0)
    model = Llama(ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=259, max_seq_len=CONTEXT))
    init_weights(model, seed=0)
    lm = KeelLM(Scorer(model, ByteTokenizer(), CONTEXT, torch.device("cpu")))
    fits, too_long = "x" * CONTEXT, "y" * (CONTEXT + 1)
    with pytest.raises(ConfigError, match=rf"continuation of {CONTEXT + 1} tokens is longer than the model's context "
                                          rf"\({CONTEXT} tokens\)"):
        lm.loglikelihood([Instance("loglikelihood", {}, ("def", too_long), 0)])
    (score, _), = lm.loglikelihood([Instance("loglikelihood", {}, ("def", fits), 0)])
    ids = [ord(c) for c in "def" + fits][-(CONTEXT + 1):]
    with torch.no_grad():
        logprobs = F.log_softmax(model(torch.tensor([ids[:-1]])).float(), -1)[0]
    assert score == pytest.approx(sum(float(logprobs[i, ids[i + 1]]) for i in range(len(ids) - 1)), rel=1e-5)
