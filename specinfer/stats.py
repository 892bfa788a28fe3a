"""Per-request generation statistics (SpecInfer Section 6's metrics): one type, one formula.

Only measured values are reported. The speculation figures (accepted tokens, tree nodes,
acceptance rate) are measured by the verifier; a request whose verifier call ended early (a
stop string, a cancel) has no such measurement, and they stay None ("unset") rather than being
estimated. Plain Python: the gateway uses this too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int = 0
    output_tokens: int = 0
    llm_steps: int = 0
    latency_s: float = 0.0
    fell_back: bool = False
    # Sums over the verified steps; None when not measured.
    num_accepted: float | None = None  # tree tokens the LLM accepted (the bonus token excluded)
    num_tree_nodes: float | None = None  # tree nodes verified, roots included
    cached_prompt_tokens: int = 0  # prompt tokens whose KV was reused (a session's prefix, a shared prompt)

    @classmethod
    def measured(cls, prompt_tokens: int, output_tokens: int, accepted_per_step: list[int],
                 tree_nodes_per_step: list[int], latency_s: float = 0.0, fell_back: bool = False
                 ) -> "GenerationStats":
        return cls(prompt_tokens, output_tokens, len(accepted_per_step), latency_s, fell_back,
                   float(sum(accepted_per_step)), float(sum(tree_nodes_per_step)))

    @property
    def tokens_per_step(self) -> float:
        return self.output_tokens / self.llm_steps if self.llm_steps else 0.0

    @property
    def mean_accepted(self) -> float | None:
        return None if self.num_accepted is None else self.num_accepted / max(1, self.llm_steps)

    @property
    def mean_tree_nodes(self) -> float | None:
        return None if self.num_tree_nodes is None else self.num_tree_nodes / max(1, self.llm_steps)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted tree tokens per speculated node (a node other than a step's root)."""
        if self.num_accepted is None or self.num_tree_nodes is None:
            return None
        speculated = self.num_tree_nodes - self.llm_steps
        return self.num_accepted / speculated if speculated > 0 else 0.0

    def merged(self, later: "GenerationStats") -> "GenerationStats":
        """Two segments of one request (before and after a resume): counts add up; a speculation
        figure stays measured only if both segments measured it (or one of them took no step)."""

        def add(a: float | None, b: float | None, steps_a: int, steps_b: int) -> float | None:
            if steps_a == 0:
                return b
            if steps_b == 0:
                return a
            return None if a is None or b is None else a + b

        return GenerationStats(
            prompt_tokens=later.prompt_tokens or self.prompt_tokens,
            output_tokens=self.output_tokens + later.output_tokens,
            llm_steps=self.llm_steps + later.llm_steps,
            latency_s=self.latency_s + later.latency_s,
            fell_back=self.fell_back or later.fell_back,
            num_accepted=add(self.num_accepted, later.num_accepted, self.llm_steps, later.llm_steps),
            num_tree_nodes=add(self.num_tree_nodes, later.num_tree_nodes, self.llm_steps, later.llm_steps),
            # the request's prompt is the first segment's; a continuation's prompt holds its output
            cached_prompt_tokens=self.cached_prompt_tokens if self.llm_steps else later.cached_prompt_tokens,
        )

    def with_counts(self, prompt_tokens: int, output_tokens: int) -> "GenerationStats":
        return replace(self, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                       cached_prompt_tokens=min(self.cached_prompt_tokens, prompt_tokens))

    def to_json(self) -> dict:
        return asdict(self)

    def summary(self) -> dict:
        """The counts and the figures derived from them, as a client reports them (a figure not
        measured is None)."""
        return {"prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "llm_steps": self.llm_steps, "tokens_per_step": self.tokens_per_step,
                "mean_accepted": self.mean_accepted, "mean_tree_nodes": self.mean_tree_nodes,
                "acceptance_rate": self.acceptance_rate, "latency_s": self.latency_s, "fell_back": self.fell_back,
                "cached_prompt_tokens": self.cached_prompt_tokens}

    @classmethod
    def from_json(cls, d: dict | None) -> "GenerationStats":
        d = dict(d or {})
        steps = d.get("llm_steps") or 0
        for total, mean in (("num_accepted", "mean_accepted"), ("num_tree_nodes", "mean_tree_nodes")):
            if total not in d:  # stored by an earlier gateway, as means
                d[total] = sum_from_mean(d.get(mean), steps)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def sum_from_mean(mean: float | None, llm_steps: int) -> float | None:
    """A speculation sum from its mean over `llm_steps` steps (what older senders carried)."""
    return None if mean is None else float(mean) * llm_steps
