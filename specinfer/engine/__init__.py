"""The engine: models, KV blocks, token trees, verification, speculation, scheduling, kernels.

Plain PyTorch and Python. It imports nothing from gRPC, protobuf, `specinfer.serving` or
`specinfer.cli`: the services and the command line wrap it, never the other way round.
"""
