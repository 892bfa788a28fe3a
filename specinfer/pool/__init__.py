"""The SSM pool (SpecInfer Section 3): SSMs cut from the LLM, collective boost-tuning, demo models."""
