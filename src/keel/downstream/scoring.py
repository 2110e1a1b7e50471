"""Text scored by keel's model: the log-likelihood of a continuation after a context, and of a whole text over
windows of the model's context. Needs no lm-evaluation-harness; its adapter (keel.downstream.adapter) and keel's
own scoring of the shipped tasks (keel.downstream.native) both score through this.

Requests are scored as lm-eval's Hugging Face model scores them (`add_bos_token=False`, its default for a
tokenizer that frames documents): whitespace that ends a context moves to the continuation, the context and
continuation are encoded together and split where the context's own encoding ends, an empty context is the BOS
token, sequences longer than the model's context keep their last tokens. A checkpoint and its Hugging Face export
therefore get the same scores, to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from keel.core.dtensor import plain
from keel.data.tokenizer import Tokenizer
from keel.errors import ConfigError

Logits = Callable[[torch.Tensor], torch.Tensor]  # (batch, seq) token ids → (batch, seq, vocab) logits
Pair = tuple[list[int], list[int]]  # a context's ids and its continuation's


class Scorer:
    """`logits` is the model's forward (every rank of a sharded model calls it with the same batches)."""

    def __init__(self, logits: Logits, tokenizer: Tokenizer, max_length: int, device: torch.device,
                 batch_size: int = 8) -> None:
        self.logits, self.tok, self.max_length, self.device = logits, tokenizer, max_length, device
        self.batch_size = batch_size

    def encode(self, text: str) -> list[int]:
        """The text's ids without keel's document delimiters."""
        return [int(i) for i in self.tok.encode_documents([text])[0][1:-1]]

    def pair(self, context: str, continuation: str) -> Pair:
        """The ids of a context and of its continuation, as lm-eval splits them."""
        if not context:
            ids = self.encode(continuation)
            return (ids[:1], ids[1:]) if ids[:1] == [self.tok.bos] else ([self.tok.bos], ids)
        kept = context.rstrip()  # a word boundary belongs to what follows it
        whole, head = self.encode(context + continuation), self.encode(kept)
        return head, whole[len(head):]

    @torch.no_grad()
    def logprobs(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Each sequence's log-probabilities (seq, vocab) in fp32, the sequences padded on the right in one batch
        (causal attention: padding after a token does not change its logits)."""
        width = max(len(s) for s in sequences)
        batch = torch.full((len(sequences), width), self.tok.pad, dtype=torch.long)
        for row, seq in enumerate(sequences):
            batch[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        logits = plain(self.logits(batch.to(self.device)))  # tensor parallel: the vocabulary's shards gathered
        logprobs = F.log_softmax(logits.float(), dim=-1).cpu()
        return [logprobs[row, :len(seq)] for row, seq in enumerate(sequences)]

    def loglikelihood(self, pairs: list[Pair]) -> list[tuple[float, bool]]:
        """(log-probability of the continuation, whether it is the greedy one) per pair, in order."""
        out: list[tuple[float, bool]] = []
        if (longest := max((len(cont) for _, cont in pairs), default=0)) > self.max_length:
            raise ConfigError(f"a task's continuation of {longest} tokens is longer than the model's context "
                              f"({self.max_length} tokens), so its log-likelihood cannot be computed; give the task "
                              f"shorter choices or evaluate a model with a longer model.max_seq_len")
        for start in range(0, len(pairs), self.batch_size):
            chunk = pairs[start:start + self.batch_size]
            inputs = [(ctx + cont)[-(self.max_length + 1):][:-1] for ctx, cont in chunk]
            for (_, cont), inp, logprobs in zip(chunk, inputs, self.logprobs(inputs), strict=True):
                scored = logprobs[len(inp) - len(cont):]  # the positions that predict the continuation
                target = torch.tensor(cont, dtype=torch.long)
                picked = scored.gather(-1, target[:, None]).squeeze(-1)
                out.append((float(picked.sum()), bool((scored.argmax(-1) == target).all())))
        return out

    def rolling(self, text: str) -> float:
        """The text's log-likelihood after BOS, predicted `max_length` tokens at a time, each window seeing the
        `max_length` ids before its last (the first window only BOS and its own; a short last one more)."""
        tokens = self.encode(text)
        ids = [self.tok.bos, *tokens]  # ids[i] predicts tokens[i]
        pairs = []
        for start in range(0, len(tokens), self.max_length):
            end = min(start + self.max_length, len(tokens))
            pairs.append((ids[max(0, end - self.max_length):start + 1], tokens[start:end]))
        return sum(score for score, _ in self.loglikelihood(pairs))
