"""specinfer: tree-based speculative inference and verification (SpecInfer, arXiv 2305.09781)."""

__version__ = "0.1.0"
