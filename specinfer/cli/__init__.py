"""The `specinfer` command line: generate, bench, up, client, demo-models, make-ssm, boost-tune."""

from specinfer.cli.main import main

__all__ = ["main"]
