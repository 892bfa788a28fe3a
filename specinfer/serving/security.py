"""Authentication and transport security for every gRPC hop.

A service may require a shared bearer token (`authorization: Bearer <token>` metadata) on every
call except the grpc.health.v1 probes, and may serve TLS (mTLS with a client CA). Outbound
channels trust a CA, may present a client certificate, and attach the token. Two secrets: the
*internal* token (`SPECINFER_AUTH_TOKEN[_FILE]`) guards the verifier and speculators and is what
the gateway and verifier send; the gateway's *public* token (`SPECINFER_GATEWAY_AUTH_TOKEN[_FILE]`)
is what clients send. Without any of these settings everything is plaintext and open, as before.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import grpc

from specinfer.errors import UserError

INTERNAL_TOKEN_ENV = ("SPECINFER_AUTH_TOKEN_FILE", "SPECINFER_AUTH_TOKEN")  # (file variable, value variable)
GATEWAY_TOKEN_ENV = ("SPECINFER_GATEWAY_AUTH_TOKEN_FILE", "SPECINFER_GATEWAY_AUTH_TOKEN")
CLIENT_TOKEN_ENV = "SPECINFER_GATEWAY_TOKEN"  # what `specinfer client` sends to the gateway
AUTH_HEADER = "authorization"
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)  # probes answer without a token


@dataclass(frozen=True)
class ServerSecurity:
    """What a server requires: a bearer token, TLS (cert + key), client certificates (mTLS)."""

    token: str | None = field(default=None, repr=False)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # set: clients must present a certificate signed by it

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise UserError("TLS needs both a certificate and its key: --tls-cert and --tls-key "
                            "(SPECINFER_TLS_CERT, SPECINFER_TLS_KEY)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise UserError("--tls-client-ca (SPECINFER_TLS_CLIENT_CA) needs --tls-cert and --tls-key")
        if self.token is not None:
            check_token(self.token, "the server's auth token")

    @property
    def is_tls(self) -> bool:
        return self.tls_cert is not None


@dataclass(frozen=True)
class ChannelSecurity:
    """How a channel calls: the token it sends, the CA it trusts (TLS), its certificate (mTLS)."""

    token: str | None = field(default=None, repr=False)
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise UserError("a client certificate needs its key: --tls-client-cert and --tls-client-key "
                            "(SPECINFER_TLS_CLIENT_CERT, SPECINFER_TLS_CLIENT_KEY)")
        if self.tls_cert is not None and self.tls_ca is None:
            raise UserError("a client certificate is for TLS channels: set --tls-ca (SPECINFER_TLS_CA) too")
        if self.token is not None:
            check_token(self.token, "the channel's auth token")

    @property
    def is_tls(self) -> bool:
        return self.tls_ca is not None


# ---- files and tokens ----------------------------------------------------------------------------
def read_file(path: Path, what: str) -> bytes:
    """A secret or PEM file's bytes; a missing, unreadable or empty file is a UserError naming it."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise UserError(f"{what}: no such file {str(path)!r}") from None
    except IsADirectoryError:
        raise UserError(f"{what}: {str(path)!r} is a directory, not a file") from None
    except OSError as exc:
        raise UserError(f"{what}: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    if not data.strip():
        raise UserError(f"{what}: {str(path)!r} is empty")
    return data


def check_token(token: str, what: str) -> str:
    if not token or not token.strip():
        raise UserError(f"{what} is empty")
    if token != token.strip() or any(not (0x21 <= ord(c) <= 0x7E) for c in token):
        raise UserError(f"{what} must be printable ASCII without spaces")
    return token


def read_token(path: Path, what: str) -> str:
    """A token file's content, without its trailing newline."""
    try:
        text = read_file(path, what).decode("ascii").strip()
    except UnicodeDecodeError:
        raise UserError(f"{what}: {str(path)!r} is not ASCII text") from None
    return check_token(text, f"{what} in {str(path)!r}")


def resolve_token(token_file: Path | None, env: Mapping[str, str], names: tuple[str, str],
                  flag: str = "--auth-token-file") -> str | None:
    """The token from `token_file` (a flag, already resolved against the file variable), else
    from the value variable `names[1]`, else None (no token)."""
    file_var, value_var = names
    if token_file is not None:
        return read_token(token_file, f"auth token file ({flag} or {file_var})")
    value = env.get(value_var)
    if value is None or value == "":
        return None
    return check_token(value, f"environment variable {value_var}")


def _checked(path: Path | None, what: str) -> Path | None:
    if path is not None:
        read_file(path, what)
    return path


def server_security(args: Mapping[str, Any], env: Mapping[str, str],
                    token_env: tuple[str, str] = INTERNAL_TOKEN_ENV) -> ServerSecurity:
    """A server's security from `settings.security_flags` values (files read now: a bad one
    fails at start-up, naming its setting)."""
    return ServerSecurity(
        token=resolve_token(args.get("auth_token_file"), env, token_env),
        tls_cert=_checked(args.get("tls_cert"), "TLS certificate (--tls-cert, SPECINFER_TLS_CERT)"),
        tls_key=_checked(args.get("tls_key"), "TLS key (--tls-key, SPECINFER_TLS_KEY)"),
        tls_client_ca=_checked(args.get("tls_client_ca"), "client CA (--tls-client-ca, SPECINFER_TLS_CLIENT_CA)"),
    )


def channel_security(args: Mapping[str, Any], env: Mapping[str, str], token: str | None) -> ChannelSecurity:
    """An outbound channel's security from `settings.security_flags` values and the token it sends."""
    return ChannelSecurity(
        token=token,
        tls_ca=_checked(args.get("tls_ca"), "CA (--tls-ca, SPECINFER_TLS_CA)"),
        tls_cert=_checked(args.get("tls_client_cert"), "client certificate (--tls-client-cert, "
                                                       "SPECINFER_TLS_CLIENT_CERT)"),
        tls_key=_checked(args.get("tls_client_key"), "client key (--tls-client-key, SPECINFER_TLS_CLIENT_KEY)"),
    )


def client_security_from_env(env: Mapping[str, str], token: str | None = None) -> ChannelSecurity:
    """A client's TLS settings from SPECINFER_TLS_CA / SPECINFER_TLS_CLIENT_CERT / _KEY."""
    paths = {name: Path(env[var]) if env.get(var) else None
             for name, var in (("tls_ca", "SPECINFER_TLS_CA"), ("tls_client_cert", "SPECINFER_TLS_CLIENT_CERT"),
                               ("tls_client_key", "SPECINFER_TLS_CLIENT_KEY"))}
    return channel_security(paths, env, token)


# ---- credentials ---------------------------------------------------------------------------------
def server_credentials(cfg: ServerSecurity) -> grpc.ServerCredentials | None:
    """TLS server credentials (requiring client certificates with a client CA); None = plaintext."""
    if not cfg.is_tls:
        return None
    pair = (read_file(cfg.tls_key, "TLS key"), read_file(cfg.tls_cert, "TLS certificate"))
    client_ca = read_file(cfg.tls_client_ca, "client CA") if cfg.tls_client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def channel_credentials(cfg: ChannelSecurity) -> grpc.ChannelCredentials | None:
    """TLS channel credentials trusting the configured CA; None = plaintext."""
    if not cfg.is_tls:
        return None
    key = read_file(cfg.tls_key, "client key") if cfg.tls_key else None
    cert = read_file(cfg.tls_cert, "client certificate") if cfg.tls_cert else None
    return grpc.ssl_channel_credentials(read_file(cfg.tls_ca, "CA"), key, cert)


def open_channel(target: str, cfg: ChannelSecurity | None = None,
                 options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
    """A channel to `target`: TLS when a CA is configured, and the bearer token on every call
    when one is configured."""
    cfg = cfg or ChannelSecurity()
    creds = channel_credentials(cfg)
    channel = (grpc.secure_channel(target, creds, options=options) if creds is not None
               else grpc.insecure_channel(target, options=options))
    if cfg.token is None:
        return channel
    return grpc.intercept_channel(channel, _TokenInterceptor(cfg.token))


def bearer(token: str) -> tuple[str, str]:
    return AUTH_HEADER, f"Bearer {token}"


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call of a channel."""

    def __init__(self, token: str):
        self.header = bearer(token)

    def _details(self, details):
        metadata = [m for m in (details.metadata or ()) if m[0] != AUTH_HEADER] + [self.header]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            getattr(details, "wait_for_ready", None), getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: list[tuple[str, str]]
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


# ---- the server side -----------------------------------------------------------------------------
class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call without `authorization: Bearer <token>` with UNAUTHENTICATED, except
    the health service. Reflection needs the token too."""

    def __init__(self, token: str):
        self._expected = f"Bearer {check_token(token, 'the auth token')}".encode()

    def is_allowed(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == AUTH_HEADER:
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._expected)
        return False

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_PREFIXES):
            return handler
        if self.is_allowed(handler_call_details.invocation_metadata):
            return handler
        has_header = any(key == AUTH_HEADER for key, _ in handler_call_details.invocation_metadata or ())
        message = "invalid bearer token" if has_header else "missing bearer token (authorization metadata)"

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        def refuse_stream(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # a generator, like the handler it replaces

        if handler.unary_unary:
            return handler._replace(unary_unary=refuse)
        if handler.stream_unary:
            return handler._replace(stream_unary=refuse)
        if handler.unary_stream:
            return handler._replace(unary_stream=refuse_stream)
        return handler._replace(stream_stream=refuse_stream)
