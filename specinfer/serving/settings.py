"""Service settings: command-line flags with environment-variable fallbacks, and their defaults.

Every service reads its configuration once, in `main()`, into a frozen dataclass: a flag wins,
then its environment variable, then the default. A malformed or out-of-range value is a
`UserError` that names the flag or the variable, which `main()` prints on one line (exit code 2).
Plain Python: the gateway imports this too.
"""

from __future__ import annotations

import argparse
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

from specinfer.errors import UserError
from specinfer.limits import DEFAULT_GRACE_S, DEFAULT_MAX_MESSAGE_BYTES, MAX_MESSAGE_BYTES, MAX_METADATA_BYTES
from specinfer.limits import MIN_MESSAGE_BYTES
from specinfer.limits import INITIAL_RECONNECT_BACKOFF_MS, MAX_RECONNECT_BACKOFF_MS, MIN_CONNECT_TIMEOUT_MS
from specinfer.util import CACHE_DIR_ENV

T = TypeVar("T")

# ---- the services' defaults ------------------------------------------------------------------
LOCAL_HOST = "127.0.0.1"  # internal services are not exposed by default
LOG_LEVELS = ("debug", "info", "warning", "error")
MAX_PORT = 65535

_TRUE = ("1", "true", "yes", "on")


def bind_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on host:port now (bound and released at once), or None.
    SO_REUSEADDR as servers bind: a port in TIME_WAIT is free, one another process holds is not."""
    host = host.strip("[]")  # "[::]" as gRPC writes IPv6
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None
_FALSE = ("0", "false", "no", "off")


def message_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """gRPC options bounding a server or a channel: messages either way, and received metadata.
    An oversize message fails its RPC with RESOURCE_EXHAUSTED before any handler sees it."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_metadata_size", MAX_METADATA_BYTES),
    ]


def reconnect_options() -> list[tuple[str, int]]:
    """gRPC options of every channel a service opens: a peer that restarts is connected to again
    within about a second of serving (see MAX_RECONNECT_BACKOFF_MS), however long it was down."""
    return [
        ("grpc.initial_reconnect_backoff_ms", INITIAL_RECONNECT_BACKOFF_MS),
        ("grpc.min_reconnect_backoff_ms", MIN_CONNECT_TIMEOUT_MS),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ]


# ---- value parsers: a plain ValueError, or a UserError with its own message ------------------
def parse_bool(text: str) -> bool:
    """1/true/yes/on or 0/false/no/off, in any case."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise UserError(f"expected one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)}")


_SIZE_UNITS = {"": 1, "b": 1, "kb": 1000, "kib": 1 << 10, "mb": 1000 ** 2, "mib": 1 << 20, "gb": 1000 ** 3,
               "gib": 1 << 30}
_SIZE = re.compile(r"^\s*(\d+)\s*([a-z]*)\s*$")


def parse_bytes(text: str) -> int:
    """A size in bytes: 4194304, 4MiB, 512KiB, 4MB (1000-based), ..."""
    match = _SIZE.match(text.lower())
    if not match or match.group(2) not in _SIZE_UNITS:
        raise UserError("expected a size in bytes such as 4194304, 4MiB or 512KiB")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2)]


parse_bytes.__name__ = "size"


def format_bytes(num_bytes: int) -> str:
    """4194304 -> '4MiB' (the largest binary unit that divides it)."""
    for unit in ("GiB", "MiB", "KiB"):
        size = _SIZE_UNITS[unit.lower()]
        if num_bytes and num_bytes % size == 0:
            return f"{num_bytes // size}{unit}"
    return str(num_bytes)


def comma_list(text: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']."""
    return [part.strip() for part in text.split(",") if part.strip()]


def one_of(choices: Sequence[str]) -> Callable[[str], str]:
    """A parser that accepts only `choices` (case-insensitive)."""

    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise UserError(f"choose one of {', '.join(choices)}")
        return value

    parse.__name__ = "choice"
    return parse


def _type_name(parse: Callable) -> str:
    return getattr(parse, "__name__", "value")


def pick(value: T | None, env: Mapping[str, str], names: str | Sequence[str], parse: Callable[[str], T],
         default: T) -> T:
    """A flag's value if given, else the first set environment variable of `names`, parsed, else
    `default`. A malformed variable is a UserError naming it."""
    if value is not None:
        return value
    for name in (names,) if isinstance(names, str) else names:
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        try:
            return parse(raw)
        except UserError as exc:
            raise UserError(f"environment variable {name}={raw!r}: {exc}") from None
        except ValueError:
            raise UserError(f"environment variable {name}={raw!r} is not a valid {_type_name(parse)}") from None
    return default


def check_range(name: str, value: float, low: float | None = None, high: float | None = None) -> None:
    """UserError unless low <= value <= high (either bound may be None)."""
    if low is not None and value < low:
        raise UserError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise UserError(f"{name} must be <= {high}, got {value}")


def positive(name: str, value: float) -> None:
    if value <= 0:
        raise UserError(f"{name} must be > 0, got {value}")


# ---- flags -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Flag:
    """One setting: its flag, its environment variable(s), how to parse it, its default."""

    name: str  # "--port"
    env: str | tuple[str, ...]  # the variable, or several tried in order
    parse: Callable[[str], Any]
    default: Any
    help: str = ""
    is_list: bool = False  # repeatable flag; the variable holds a comma-separated list
    low: float | None = None  # inclusive bounds, checked whatever the value's source
    high: float | None = None
    is_positive: bool = False  # > 0
    shown_default: str | None = None  # the default as the help text shows it, when not str(default)
    is_switch: bool = False  # an on/off setting: --name and --no-name on the command line, parse_bool in the variable

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    @property
    def envs(self) -> tuple[str, ...]:
        return (self.env,) if isinstance(self.env, str) else self.env


def _for_argparse(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """argparse reports a UserError's own message, not 'invalid <type> value'."""

    def wrapped(text: str):
        try:
            return parse(text)
        except UserError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None

    wrapped.__name__ = _type_name(parse)
    return wrapped


def add_flag(p: argparse.ArgumentParser, flag: Flag) -> None:
    """Adds the flag with no argparse default, so an unset flag can fall back to the environment."""
    shown = flag.shown_default
    if shown is None and flag.default not in (None, (), []):
        is_seq = isinstance(flag.default, (tuple, list))
        shown = ",".join(map(str, flag.default)) if is_seq else str(flag.default)
    default = f", default {shown}" if shown else ""
    help_text = f"{flag.help} (env {' or '.join(flag.envs)}{default})".lstrip()
    if flag.is_switch:  # --name (on), --name VALUE (as the variable takes it), --no-name (off)
        p.add_argument(flag.name, nargs="?", const=True, type=_for_argparse(flag.parse), default=None,
                       help=help_text, metavar="on|off")
        p.add_argument("--no-" + flag.name.removeprefix("--"), dest=flag.dest, action="store_const", const=False,
                       help=argparse.SUPPRESS)
        return
    p.add_argument(flag.name, type=_for_argparse(flag.parse), default=None, help=help_text,
                   action="append" if flag.is_list else "store")


def read_flags(p: argparse.ArgumentParser, flags: Sequence[Flag], argv: list[str] | None,
               env: Mapping[str, str]) -> dict[str, Any]:
    """Parses `argv` with `p` (which holds `flags`, added by `add_flag`, and maybe other
    arguments); returns every argument by destination, each flag resolved flag > env > default
    and range-checked."""
    return resolve_flags(vars(p.parse_args(argv)), flags, env)


def resolve_flags(args: dict[str, Any], flags: Sequence[Flag], env: Mapping[str, str]) -> dict[str, Any]:
    """`args` (parsed, by destination) with each of `flags` resolved flag > env > default and
    range-checked."""
    for flag in flags:
        if flag.is_list:
            parse_list = lambda text, parse=flag.parse: [parse(item) for item in comma_list(text)]  # noqa: E731
            parse_list.__name__ = f"comma-separated list of {_type_name(flag.parse)}"
            value = pick(args[flag.dest], env, flag.envs, parse_list, None)
            value = tuple(flag.default if value is None else value)
        else:
            value = pick(args[flag.dest], env, flag.envs, flag.parse, flag.default)
        where = f"{flag.name} ({' or '.join(flag.envs)})"
        if value is not None and not flag.is_list:
            check_range(where, value, flag.low, flag.high)
            if flag.is_positive:
                positive(where, value)
        args[flag.dest] = value
    return args


def cache_dir_flag() -> Flag:
    """Where a model service caches what it measures at load time (the SSMs' dtype); without it,
    $SPECINFER_CACHE_DIR, else ~/.cache/specinfer (`specinfer.util.default_cache_dir`)."""
    return Flag("--cache-dir", CACHE_DIR_ENV, Path, None,
                "where load-time measurements are cached; unwritable: measured at every start",
                shown_default="~/.cache/specinfer")


def port_flag(name: str, env: str, default: int, help_text: str) -> Flag:
    return Flag(name, env, int, default, help_text, low=0, high=MAX_PORT)


def common_flags(defaults: dict[str, Any], has_threads: bool = True) -> list[Flag]:
    """The settings every service has: tracing, metrics, logs, draining, the message size bound
    (and torch threads for the model services). `defaults` maps the config's field names to
    their defaults."""
    flags = [
        Flag("--otlp-endpoint", "SPECINFER_OTLP_ENDPOINT", str, defaults["otlp_endpoint"],
             "OTLP/gRPC trace endpoint; unset = off"),
        port_flag("--metrics-port", "SPECINFER_METRICS_PORT", defaults["metrics_port"],
                  "Prometheus /metrics port; 0 = off"),
        Flag("--log-level", "SPECINFER_LOG_LEVEL", one_of(LOG_LEVELS), defaults["log_level"], ", ".join(LOG_LEVELS)),
        Flag("--instance-id", "SPECINFER_INSTANCE_ID", str, defaults.get("instance_id", ""),
             "a name for this process: its health service also answers SERVING for specinfer.instance.<id>, so "
             "whoever started it can tell it from another process on its port; unset = none"),
        Flag("--grace-s", "SPECINFER_GRACE_S", float, defaults["grace_s"],
             "the most a drain on SIGTERM takes: requests in flight get the time their tokens left need at the "
             "measured speed, within this; one that cannot finish is handed over (set the orchestrator's grace "
             "period, e.g. terminationGracePeriodSeconds, to the same value)", low=0),
        Flag("--max-message-bytes", "SPECINFER_MAX_MESSAGE_BYTES", parse_bytes, defaults["max_message_bytes"],
             "largest gRPC message received or sent, by this server and the channels it opens (4MiB, 512KiB)",
             low=MIN_MESSAGE_BYTES, high=MAX_MESSAGE_BYTES, shown_default=format_bytes(defaults["max_message_bytes"])),
    ]
    if has_threads:
        flags.append(Flag("--threads", "SPECINFER_THREADS", int, defaults["num_threads"],
                          "torch intra-op threads (0 = torch's default)", low=0))
    return flags


def security_flags(token_file_env: str = "SPECINFER_AUTH_TOKEN_FILE", token_env: str = "SPECINFER_AUTH_TOKEN",
                   outbound_token: tuple[str, str] | None = None, has_channels: bool = True) -> list[Flag]:
    """A service's authentication and TLS settings (read by `specinfer.serving.security`): the
    bearer token callers must send, its TLS certificate (and client CA for mTLS), and, for a
    service that calls another, the CA its channels trust and its client certificate.
    `outbound_token` = (flag, file variable) when the token it sends is not the one it checks."""
    flags = [
        Flag("--auth-token-file", token_file_env, Path, None,
             f"file holding the bearer token every call but health checks must send (or the token itself in "
             f"{token_env}); unset = no authentication"),
        Flag("--tls-cert", "SPECINFER_TLS_CERT", Path, None, "PEM server certificate: serve TLS"),
        Flag("--tls-key", "SPECINFER_TLS_KEY", Path, None, "PEM private key of --tls-cert"),
        Flag("--tls-client-ca", "SPECINFER_TLS_CLIENT_CA", Path, None,
             "PEM CA: require client certificates signed by it (mTLS)"),
    ]
    if outbound_token is not None:
        flags.append(Flag(outbound_token[0], outbound_token[1], Path, None,
                          "file holding the internal bearer token sent downstream (or the token itself in "
                          f"{outbound_token[1].removesuffix('_FILE')})"))
    if has_channels:
        flags += [
            Flag("--tls-ca", "SPECINFER_TLS_CA", Path, None, "PEM CA that outbound channels trust: use TLS"),
            Flag("--tls-client-cert", "SPECINFER_TLS_CLIENT_CERT", Path, None,
                 "PEM client certificate outbound channels present (mTLS)"),
            Flag("--tls-client-key", "SPECINFER_TLS_CLIENT_KEY", Path, None, "PEM private key of --tls-client-cert"),
        ]
    return flags
