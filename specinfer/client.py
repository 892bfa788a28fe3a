"""The Python client of the gateway's gRPC API (`specinfer.v1.Gateway`).

    from specinfer.client import GatewayClient
    with GatewayClient("127.0.0.1:50051") as client:
        done = client.generate("def add(", max_tokens=16, logprobs=2, n=2, stop_token_ids=[13])

It lives beside the `specinfer client` command (`specinfer.cli.client`); this is its import path.
"""

from specinfer.cli.client import Completion, Delta, GatewayClient, GatewayError, RequestInfo, Sample
from specinfer.logprobs import TokenLogprob
from specinfer.params import sample_seed
from specinfer.stats import GenerationStats

Stats = GenerationStats  # the name results' stats had here before

__all__ = ["Completion", "Delta", "GatewayClient", "GatewayError", "GenerationStats", "RequestInfo", "Sample", "Stats",
           "TokenLogprob", "sample_seed"]
