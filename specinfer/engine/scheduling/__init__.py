"""Continuous batching over the paged KV cache: blocks, the scheduler, its workers and policies."""
