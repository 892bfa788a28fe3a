"""Tree verification (SpecInfer Section 4): the LLM pass, acceptance, sampling and logit processing."""
