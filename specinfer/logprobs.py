"""Log probabilities of generated tokens, as every hop carries them (plain Python: no torch).

A request that asks for logprobs gets, for every generated token, its log probability and the
`num_logprobs` most likely tokens at its position, under the distribution the token was drawn
from (SpecInfer Section 4.3: stochastic verification samples exactly the LLM's warped
distribution, so that is the one reported): "processed" = log_softmax of the logits after
temperature, top-k and top-p; for greedy requests, whose distribution is a point mass, "raw" =
log_softmax of the LLM's logits. They come from the logits the verifier already computed for the
accepted path: no extra forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

RAW = "raw"
PROCESSED = "processed"


def space_for(is_greedy: bool) -> str:
    """Which distribution a request's logprobs are taken under."""
    return RAW if is_greedy else PROCESSED


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first

    def to_json(self) -> dict:
        return {"token_id": self.token_id, "logprob": self.logprob, "top": [list(t) for t in self.top]}

    @classmethod
    def from_json(cls, d: dict) -> "TokenLogprob":
        return cls(int(d["token_id"]), float(d["logprob"]), tuple((int(t), float(lp)) for t, lp in d.get("top", ())))
