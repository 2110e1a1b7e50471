"""keel's model as lm-evaluation-harness sees one: an `lm_eval` TemplateLM over keel's scorer, so that a
checkpoint, or the model a run is training, is evaluated as it is, with no export (requests are scored as
keel.downstream.scoring says)."""

from __future__ import annotations

from typing import Any

from lm_eval.api.model import TemplateLM

from keel.downstream.scoring import Scorer


class KeelLM(TemplateLM):
    def __init__(self, scorer: Scorer, max_gen_toks: int = 256) -> None:
        super().__init__()
        self.scorer, self.max_gen_toks, self.batch_size = scorer, max_gen_toks, scorer.batch_size

    # ------------------------------------------------------------------ tokens
    @property
    def eot_token_id(self) -> int:
        return self.scorer.tok.eos

    @property
    def prefix_token_id(self) -> int:
        return self.scorer.tok.bos

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The text's ids without keel's document delimiters (with BOS first when asked for)."""
        ids = self.scorer.encode(string)
        return [self.prefix_token_id, *ids] if add_special_tokens else ids

    def tok_decode(self, ids: list[int]) -> str:
        return self.scorer.tok.decode(ids)

    # ------------------------------------------------------------------ scoring
    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, override_bs: int | None = None,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(log-probability of the continuation, whether it is the greedy one) per request, in order, in batches of
        the scorer's size."""
        return self.scorer.loglikelihood([(ctx, cont) for _, ctx, cont in requests])

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over windows of the model's context (perplexity tasks)."""
        return [self.scorer.rolling(text) for (text,) in (req.args for req in requests)]

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
                (logprobs,) = self.scorer.logprobs([(ids + made)[-self.max_length:]])
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
