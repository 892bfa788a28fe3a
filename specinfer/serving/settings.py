"""The one way an option is declared and read: `Flag` (its flag, its environment variable, how
it parses, its default, its bounds), `add_flag` / `add_declared` / `add_exclusive` (the only
callers of argparse's `add_argument`) and `resolve_flags` / `resolve_declared`.

Every service reads its configuration once, in `main()`, into a frozen dataclass, and every
command resolves its parsed arguments the same way: a flag wins, then its environment variable,
then the default. A malformed or out-of-range value is a `UserError` that names the flag or the
variable, which `main()` prints on one line (exit code 2). The options themselves are declared in
`specinfer.serving.shared_flags`. Plain Python: the gateway imports this too.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, TypeVar

from specinfer.errors import UserError
from specinfer.limits import DEFAULT_GRACE_S, DEFAULT_MAX_MESSAGE_BYTES, MAX_METADATA_BYTES
from specinfer.limits import INITIAL_RECONNECT_BACKOFF_MS, MAX_RECONNECT_BACKOFF_MS, MIN_CONNECT_TIMEOUT_MS

T = TypeVar("T")
__all__ = ["DEFAULT_GRACE_S"]  # the services' default, imported from here

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


# ---- flags: the one way an option is declared ----------------------------------------------
@dataclass(frozen=True)
class Flag:
    """One option: its flag, its environment variable(s), how to parse it, its default.

    Options are declared in `specinfer.serving.shared_flags` (or, one a single service has, in
    that service's `config.py`) and added to a parser only by `add_flag` / `add_declared`."""

    name: str  # "--port", or a positional argument's name ("request_id")
    env: str | tuple[str, ...]  # the variable, or several tried in order; () = none (a command-line-only option)
    parse: Callable[[str], Any]
    default: Any
    help: str = ""
    is_list: bool = False  # repeatable flag; the variable holds a comma-separated list
    low: float | None = None  # inclusive bounds, checked whatever the value's source
    high: float | None = None
    is_positive: bool = False  # > 0
    shown_default: str | None = None  # the default as the help text shows it, when not str(default)
    is_switch: bool = False  # an on/off setting: --name and --no-name on the command line, parse_bool in the variable
    is_toggle: bool = False  # --name alone turns it on (no value); off unless given
    choices: tuple[str, ...] = ()  # the values argparse accepts, as given (case-sensitive)
    metavar: str | None = None
    nargs: str | None = None  # "+", "*" or "?": several values after one flag (a list), or an optional positional
    is_required: bool = False
    short: str | None = None  # a one-letter alias, "-n"

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    @property
    def envs(self) -> tuple[str, ...]:
        return (self.env,) if isinstance(self.env, str) else tuple(self.env)

    @property
    def is_positional(self) -> bool:
        return not self.name.startswith("-")


def _for_argparse(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """argparse reports a UserError's own message, not 'invalid <type> value'."""

    def wrapped(text: str):
        try:
            return parse(text)
        except UserError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None

    wrapped.__name__ = _type_name(parse)
    return wrapped


def _help_text(flag: Flag) -> str:
    """The help as written, and for an option with a variable: that variable and the default."""
    if not flag.envs:
        return flag.help
    shown = flag.shown_default
    if shown is None and flag.default not in (None, (), []):
        is_seq = isinstance(flag.default, (tuple, list))
        shown = ",".join(map(str, flag.default)) if is_seq else str(flag.default)
    default = f", default {shown}" if shown else ""
    return f"{flag.help} (env {' or '.join(flag.envs)}{default})".lstrip()


def add_flag(p: argparse.ArgumentParser, flag: Flag) -> None:
    """Adds the option to a parser (or an argument group). One with a variable gets no argparse
    default, so an unset flag can fall back to the variable (`resolve_flags`); one without gets
    its default from argparse, so any parser reads it whole."""
    has_env = bool(flag.envs)
    names = [flag.name] if flag.short is None else [flag.short, flag.name]
    extra: dict[str, Any] = {"help": _help_text(flag)}
    if flag.is_positional:
        p.add_argument(flag.name, type=_for_argparse(flag.parse), nargs=flag.nargs, default=flag.default, **extra)
        return
    if flag.is_required:
        extra["required"] = True
    if flag.is_toggle:
        p.add_argument(*names, action="store_const", const=True, default=None if has_env else flag.default, **extra)
        return
    if flag.metavar is not None:
        extra["metavar"] = flag.metavar
    if flag.choices:
        extra["choices"] = flag.choices
    if flag.is_switch:  # --name (on), --name VALUE (as the variable takes it), --no-name (off)
        p.add_argument(*names, nargs="?", const=True, type=_for_argparse(flag.parse), default=None,
                       **{"metavar": "on|off", **extra})
        p.add_argument("--no-" + flag.name.removeprefix("--"), dest=flag.dest, action="store_const", const=False,
                       help=argparse.SUPPRESS)
        return
    default = None
    if not has_env:
        is_seq = (flag.is_list or flag.nargs) and flag.default is not None
        default = list(flag.default) if is_seq else flag.default  # argparse appends to a copy of a list
    action = "append" if flag.is_list and not flag.nargs else "store"
    p.add_argument(*names, type=_for_argparse(flag.parse), default=default, action=action, nargs=flag.nargs, **extra)


_DECLARED = "_declared_flags"


def add_declared(p: argparse.ArgumentParser, *flags: Flag) -> None:
    """Adds `flags` to a command's parser; `resolve_declared` fills them in after parsing."""
    for flag in flags:
        add_flag(p, flag)
    _record(p, flags)


def add_exclusive(p: argparse.ArgumentParser, *flags: Flag, is_required: bool = False) -> None:
    """Adds `flags` as a group of which at most one (with `is_required`: exactly one) is given."""
    group = p.add_mutually_exclusive_group(required=is_required)
    for flag in flags:
        add_flag(group, flag)
    _record(p, flags)


def _record(p: argparse.ArgumentParser, flags: Sequence[Flag]) -> None:
    p.set_defaults(**{_DECLARED: tuple(p.get_default(_DECLARED) or ()) + tuple(flags)})


def resolve_declared(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Each declared flag of the parsed command: the flag, else its variable, else its default,
    range-checked. Resolving resolved arguments again changes nothing."""
    flags = getattr(args, _DECLARED, ())
    values = resolve_flags(vars(args), flags, os.environ if env is None else env)
    for flag in flags:
        setattr(args, flag.dest, values[flag.dest])
    return args


def read_flags(p: argparse.ArgumentParser, flags: Sequence[Flag], argv: list[str] | None,
               env: Mapping[str, str]) -> dict[str, Any]:
    """Parses `argv` with `p` (which holds `flags`, added by `add_flag`, and maybe other
    arguments); returns every argument by destination, each flag resolved flag > env > default
    and range-checked."""
    return resolve_flags(vars(p.parse_args(argv)), flags, env)


def resolve_flags(args: dict[str, Any], flags: Sequence[Flag], env: Mapping[str, str]) -> dict[str, Any]:
    """`args` (parsed, by destination) with each of `flags` resolved flag > env > default and
    range-checked (an option without a variable already holds its value, argparse's default
    included)."""
    for flag in flags:
        if not flag.envs:
            value = args.get(flag.dest)
        elif flag.is_list:
            parse_list = lambda text, parse=flag.parse: [parse(item) for item in comma_list(text)]  # noqa: E731
            parse_list.__name__ = f"comma-separated list of {_type_name(flag.parse)}"
            value = pick(args[flag.dest], env, flag.envs, parse_list, None)
            value = tuple(flag.default if value is None else value)
        else:
            value = pick(args[flag.dest], env, flag.envs, flag.parse, flag.default)
        where = f"{flag.name} ({' or '.join(flag.envs)})" if flag.envs else flag.name
        if value is not None and not (flag.is_list or flag.nargs in ("+", "*")):
            check_range(where, value, flag.low, flag.high)
            if flag.is_positive:
                positive(where, value)
        args[flag.dest] = value
    return args
