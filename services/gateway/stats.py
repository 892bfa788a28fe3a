"""Per-request generation statistics (the GenerationStats message) as plain dicts.

The verifier reports tokens per step and acceptance (SpecInfer Section 6's metrics) on its last
message. A request whose verifier call the gateway ended early (a stop sequence, a cancel) never
gets that message, so the gateway counts steps itself as a fallback; a resumed request merges
the statistics of its verifier calls, weighting means by steps.
"""

from __future__ import annotations


def counted_stats(num_tokens: int, num_steps: int) -> dict:
    """What the gateway can tell from the stream alone: tokens per verified step."""
    tokens_per_step = num_tokens / num_steps if num_steps else 0.0
    return {"llm_steps": num_steps, "tokens_per_step": tokens_per_step,
            "mean_accepted": max(0.0, tokens_per_step - 1.0) if num_steps else 0.0,
            "mean_tree_nodes": 0.0, "acceptance_rate": 0.0, "fell_back": False}


def merge_stats(prev: dict, cur: dict) -> dict:
    """Combines two segments of one request (before and after a resume)."""
    a, b = int(prev.get("llm_steps", 0)), int(cur.get("llm_steps", 0))
    if a == 0:
        return dict(cur, latency_s=float(prev.get("latency_s", 0.0)) + float(cur.get("latency_s", 0.0)))
    if b == 0:
        return dict(prev, latency_s=float(prev.get("latency_s", 0.0)) + float(cur.get("latency_s", 0.0)))

    def mean(key: str) -> float:
        return (float(prev.get(key, 0.0)) * a + float(cur.get(key, 0.0)) * b) / (a + b)

    spec_a = max(0.0, float(prev.get("mean_tree_nodes", 0.0)) - 1) * a
    spec_b = max(0.0, float(cur.get("mean_tree_nodes", 0.0)) - 1) * b
    accepted = float(prev.get("mean_accepted", 0.0)) * a + float(cur.get("mean_accepted", 0.0)) * b
    return {
        "llm_steps": a + b, "tokens_per_step": mean("tokens_per_step"), "mean_accepted": mean("mean_accepted"),
        "mean_tree_nodes": mean("mean_tree_nodes"),
        "acceptance_rate": accepted / (spec_a + spec_b) if spec_a + spec_b > 0 else 0.0,
        "latency_s": float(prev.get("latency_s", 0.0)) + float(cur.get("latency_s", 0.0)),
        "fell_back": bool(prev.get("fell_back")) or bool(cur.get("fell_back")),
    }


def final_stats(stats: dict, num_prompt_tokens: int, num_output_tokens: int) -> dict:
    """Token counts are the gateway's own: the prompt it sent and the tokens the client got."""
    return dict(stats, prompt_tokens=num_prompt_tokens, output_tokens=num_output_tokens)
