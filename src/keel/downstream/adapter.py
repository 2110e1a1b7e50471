"""keel's model as lm-evaluation-harness sees one: an `lm_eval` TemplateLM over a function from token ids to
logits and keel's tokenizer, so that a checkpoint, or the model a run is training, is evaluated as it is,
with no export.

Requests are scored as lm-eval's Hugging Face model scores them (`add_bos_token=False`, its default for a
tokenizer that frames documents): the context and continuation are encoded together and split where the
context's own encoding ends, an empty context is the BOS token, sequences longer than the model's context
keep their last tokens. A checkpoint and its Hugging Face export therefore get the same scores, to float
rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from keel.core.dtensor import plain
from keel.data.tokenizer import Tokenizer
from keel.errors import ConfigError

Logits = Callable[[torch.Tensor], torch.Tensor]  # (batch, seq) token ids → (batch, seq, vocab) logits


class KeelLM(TemplateLM):
    """`logits` is the model's forward (every rank of a sharded model calls it with the same batches)."""

    def __init__(self, logits: Logits, tokenizer: Tokenizer, max_length: int, device: torch.device,
                 batch_size: int = 8, max_gen_toks: int = 256) -> None:
        super().__init__()
        self.logits, self.tok, self._max_length, self.target = logits, tokenizer, max_length, device
        self.batch_size, self.max_gen_toks = batch_size, max_gen_toks

    # ------------------------------------------------------------------ tokens
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The text's ids without keel's document delimiters (with BOS first when asked for)."""
        ids = [int(i) for i in self.tok.encode_documents([string])[0][1:-1]]
        return [self.tok.bos, *ids] if add_special_tokens else ids

    def tok_decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    # ------------------------------------------------------------------ scoring
    @torch.no_grad()
    def _logprobs(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Each sequence's log-probabilities (seq, vocab) in fp32, the sequences padded on the right in one batch
        (causal attention: padding after a token does not change its logits)."""
        width = max(len(s) for s in sequences)
        batch = torch.full((len(sequences), width), self.tok.pad, dtype=torch.long)
        for row, seq in enumerate(sequences):
            batch[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        logits = plain(self.logits(batch.to(self.target)))  # tensor parallel: the vocabulary's shards gathered
        logprobs = F.log_softmax(logits.float(), dim=-1).cpu()
        return [logprobs[row, :len(seq)] for row, seq in enumerate(sequences)]

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, override_bs: int | None = None,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(log-probability of the continuation, whether it is the greedy one) per request, in order."""
        out: list[tuple[float, bool]] = []
        size = override_bs or self.batch_size
        if (longest := max((len(cont) for _, _, cont in requests), default=0)) > self.max_length:
            raise ConfigError(f"a task's continuation of {longest} tokens is longer than the model's context "
                              f"({self.max_length} tokens), so its log-likelihood cannot be computed; give the task "
                              f"shorter choices or evaluate a model with a longer model.max_seq_len")
        for start in range(0, len(requests), size):
            chunk = requests[start:start + size]
            inputs = [(ctx + cont)[-(self.max_length + 1):][:-1] for _, ctx, cont in chunk]
            for (_, _, cont), inp, logprobs in zip(chunk, inputs, self._logprobs(inputs), strict=True):
                scored = logprobs[len(inp) - len(cont):]  # the positions that predict the continuation
                target = torch.tensor(cont, dtype=torch.long)
                picked = scored.gather(-1, target[:, None]).squeeze(-1)
                out.append((float(picked.sum()), bool((scored.argmax(-1) == target).all())))
        return out

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over windows of the model's context (perplexity tasks)."""
        out = []
        for (text,) in (req.args for req in requests):
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)]
            scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows])
            out.append(sum(score for score, _ in scores))
        return out

    @torch.no_grad()
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first stop string (or EOS, or `max_gen_toks` tokens)."""
        out = []
        for context, gen_kwargs in (req.args for req in requests):
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            budget = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = self.tok_encode(context)[-max(self.max_length - budget, 1):] or [self.prefix_token_id]
            made: list[int] = []
            text = ""
            for _ in range(budget):
                (logprobs,) = self._logprobs([(ids + made)[-self.max_length:]])
                token = int(logprobs[-1].argmax())
                if token == self.eot_token_id:
                    break
                made.append(token)
                text = self.tok_decode(made)
                if any(stop in text for stop in until):
                    break
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out
