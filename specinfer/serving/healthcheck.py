"""`python -m specinfer.serving.healthcheck HOST:PORT [SERVICE]`: a grpc.health.v1 probe.

Every service (gateway, verifier, speculator) serves the standard gRPC health service; this
asks it once and exits

    0  the server reports SERVING for SERVICE ("" = the server as a whole, the default),
    1  anything else: NOT_SERVING (e.g. draining after SIGTERM), unknown service, nothing
       listening, or no answer within --timeout,
    2  bad usage.

It is the container HEALTHCHECK (compose) and works as a Kubernetes exec probe too, with
nothing downloaded: it needs only grpcio and grpcio-health-checking, which every image has,
and imports no model code, so a probe costs a fraction of a second.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specinfer.errors import UserError
from specinfer.serving.security import client_security_from_env, open_channel
from specinfer.serving.settings import add_declared, message_options
from specinfer.serving.shared_flags import healthcheck_flags

SERVING = health_pb2.HealthCheckResponse.SERVING


def check(target: str, service: str = "", timeout_s: float = 3.0) -> tuple[bool, str]:
    """Asks `target` (host:port or any gRPC target) for `service`'s health: (is_serving, what).
    Over TLS when SPECINFER_TLS_CA is set (with SPECINFER_TLS_CLIENT_CERT/_KEY for mTLS); health
    needs no token."""
    try:
        security = client_security_from_env(os.environ)
    except UserError as exc:
        return False, f"bad TLS settings: {exc}"
    with open_channel(target, security, message_options()) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            name = code.name if code is not None else type(exc).__name__
            return False, f"{name}: {exc.details() if hasattr(exc, 'details') else exc}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == SERVING, status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specinfer.serving.healthcheck",
                                description="grpc.health.v1 probe: exit 0 when SERVING, 1 otherwise.")
    add_declared(p, *healthcheck_flags())
    args = p.parse_args(argv)
    if args.timeout <= 0:
        p.error("--timeout must be > 0")
    is_serving, what = check(args.target, args.service, args.timeout)
    if not args.quiet:
        label = f"{args.target} {args.service}".rstrip()
        print(f"{label}: {what}", file=sys.stdout if is_serving else sys.stderr)
    return 0 if is_serving else 1


if __name__ == "__main__":
    sys.exit(main())
