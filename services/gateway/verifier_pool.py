"""The verifiers a gateway sends requests to: who they are, which are serving, and one call's route.

`VerifierTargets` is what the operator gave: a list of `host:port` addresses, or one
`dns:///host:port` name that the gateway resolves itself (every address it answers, again every
`dns_refresh_s`, so verifier replicas that come and go under one DNS name, as compose's
`--scale` and a Kubernetes headless Service make them, are found). Each address gets its own
channel (`VerifierClient`) and a health watcher: a verifier takes requests only while its health
says SERVING (one that drains, restarts or cannot be reached leaves at once, and comes back as
soon as it serves again, its channel already connected). When it becomes SERVING the gateway
asks its Info (its KV block size, for routing), and then every `VERIFIER_LOAD_POLL_S` what it
serves (Verifier.Load: batch capacity, requests running, free KV, measured time per token), which
admission follows.

`RoutedVerifiers` is what a request run calls: it routes the call (`routing.Router`) among the
serving verifiers, preferring ones the request has not failed on yet, waits briefly
(`ROUTE_WAIT_S`) when none is serving, and marks a verifier whose call failed with UNAVAILABLE
down until its health says otherwise.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway.routing import Candidate, Route, Router
from services.gateway.telemetry import GatewayMetrics
from services.gateway.verifier_client import VerifierCall, VerifierClient, VerifierStep, VerifierStream, VerifierSummary
from specinfer.serving.capacity import VerifierLoad
from specinfer.errors import PeerError, UnavailableError, UserError
from specinfer.limits import (
    DEFAULT_DNS_REFRESH_S, DEFAULT_KV_BLOCK_SIZE, HEALTH_POLL_S, HEALTH_TIMEOUT_S, ROUTE_WAIT_S, VERIFIER_LOAD_POLL_S,
    VERIFIER_PORT,
)

log = logging.getLogger(__name__)

VERIFIER_SERVICE = "specinfer.v1.Verifier"  # the health name a verifier serves under
UNKNOWN, SERVING, DOWN = "unknown", "serving", "down"


def _host_port(text: str, what: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` as (host, port); UserError naming `what` otherwise."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise UserError(f"{what}: {text!r} is not host:port")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise UserError(f"{what}: port {port} of {text!r} is not in [1, 65535]")
    if host.startswith("["):
        if not host.endswith("]"):
            raise UserError(f"{what}: {text!r} is not host:port")
        host = host[1:-1]
    elif ":" in host:
        raise UserError(f"{what}: an IPv6 address goes in brackets, [{host}]:{port}")
    return host, port


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class VerifierTargets:
    """Where the verifiers are: fixed addresses, or a DNS name resolved to all of its addresses."""

    addresses: tuple[str, ...] = ()  # host:port each (fixed)
    dns_host: str = ""  # dns:///host:port: resolved by the gateway
    dns_port: int = VERIFIER_PORT

    @classmethod
    def parse(cls, text: str, what: str = "--verifier-addr") -> "VerifierTargets":
        """`host:port[,host:port...]` or `dns:///host[:port]` (also `dns:host[:port]`)."""
        text = text.strip()
        if text.startswith("dns:"):
            rest = text[len("dns:"):]
            if rest.startswith("//"):
                authority, slash, rest = rest[2:].partition("/")
                if not slash or authority:
                    raise UserError(f"{what}: {text!r}: use dns:///host:port (no DNS server authority)")
            if not rest or "," in rest:
                raise UserError(f"{what}: {text!r}: dns:/// takes one name, dns:///host:port")
            if rest.rpartition(":")[2].isdigit() and not rest.endswith("]"):
                host, port = _host_port(rest, what)
            else:
                host, port = rest.strip("[]"), VERIFIER_PORT
            return cls(dns_host=host, dns_port=port)
        if "://" in text or text.split(":", 1)[0] in ("unix", "ipv4", "ipv6"):
            raise UserError(f"{what}: {text!r}: give host:port addresses, comma-separated, or dns:///host:port")
        parts = [p.strip() for p in text.split(",")]
        if not text or any(not p for p in parts):
            raise UserError(f"{what}: {text!r}: an empty address in the list")
        addresses = tuple(_join(*_host_port(p, what)) for p in parts)
        seen: set[str] = set()
        for a in addresses:
            if a in seen:
                raise UserError(f"{what}: {a} is listed twice")
            seen.add(a)
        return cls(addresses=addresses)

    @property
    def is_dns(self) -> bool:
        return bool(self.dns_host)

    def describe(self) -> str:
        return f"dns:///{_join(self.dns_host, self.dns_port)}" if self.is_dns else ",".join(self.addresses)

    def resolve(self) -> tuple[str, ...]:
        """Every address the targets name now (sorted); OSError when the name does not resolve."""
        if not self.is_dns:
            return self.addresses
        infos = socket.getaddrinfo(self.dns_host, self.dns_port, type=socket.SOCK_STREAM)
        return tuple(sorted({_join(info[4][0], self.dns_port) for info in infos}))

    def tls_name(self) -> str | None:
        """The name a resolved address's certificate is checked against (the DNS name, not the IP)."""
        if not self.is_dns:
            return None
        try:
            ipaddress.ip_address(self.dns_host)
            return None
        except ValueError:
            return self.dns_host


@dataclass(frozen=True)
class PoolConfig:
    dns_refresh_s: float = DEFAULT_DNS_REFRESH_S
    health_poll_s: float = HEALTH_POLL_S
    load_poll_s: float = VERIFIER_LOAD_POLL_S  # how often a serving verifier is asked what it serves
    health_timeout_s: float = HEALTH_TIMEOUT_S
    default_block_size: int = DEFAULT_KV_BLOCK_SIZE  # until a verifier reports its own


@dataclass
class Member:
    """One verifier address: its channel, its health as last seen, what its Info said."""

    address: str
    client: VerifierClient
    state: str = UNKNOWN
    block_size: int = 0  # 0 = not reported
    summary: VerifierSummary | None = None
    load: VerifierLoad | None = None  # what it serves, as it last reported (Verifier.Load)
    num_mine: int = 0  # this gateway's calls on it when it reported
    load_at: float = -math.inf  # monotonic time of that report
    is_leaving: bool = False  # gone from DNS: no new calls; closed once its calls ended
    stop: threading.Event = field(default_factory=threading.Event)


class VerifierPool:
    """The members, kept up to date by one resolver thread (DNS targets) and one health watcher
    per member. `on_change(address, state)` is told every health transition."""

    def __init__(self, targets: VerifierTargets, make_client: Callable[[str], VerifierClient],
                 cfg: PoolConfig | None = None, on_change: Callable[[str, str], None] = lambda a, s: None,
                 in_flight: Callable[[str], int] = lambda address: 0):
        self.targets = targets
        self.on_load: Callable[[], None] = lambda: None  # told after every load report
        self._in_flight = in_flight
        self.cfg = cfg or PoolConfig()
        self._make_client = make_client
        self._on_change = on_change
        self._cond = threading.Condition()
        self._members: dict[str, Member] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- membership -------------------------------------------------------------------------
    def start(self) -> None:
        self._refresh()
        if self.targets.is_dns:
            thread = threading.Thread(target=self._keep_resolving, name="verifier-dns", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _keep_resolving(self) -> None:
        while not self._stop.wait(self.cfg.dns_refresh_s):
            self._refresh()

    def _refresh(self) -> None:
        try:
            addresses = self.targets.resolve()
        except OSError as exc:  # keep what we have; the name may resolve later
            log.warning("verifier address %s does not resolve: %s", self.targets.describe(), exc)
            return
        with self._cond:
            current = set(self._members)
            added = [a for a in addresses if a not in current]
            gone = [a for a in current if a not in addresses]
            for address in added:
                self._members[address] = Member(address, self._make_client(address))
            for address in gone:
                self._members[address].is_leaving = True
            self._cond.notify_all()
        for address in added:
            log.info("verifier %s joined", address)
            member = self._members[address]
            thread = threading.Thread(target=self._watch, args=(member,), name=f"verifier-health-{address}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)
        for address in gone:
            log.info("verifier %s left %s", address, self.targets.describe())
            self._set_state(self._members[address], DOWN)
        for address in self.leaving():
            self.retire(address, self._in_flight(address))

    def retire(self, address: str, num_in_flight: int) -> None:
        """Closes a member that left DNS once no call runs on it any more."""
        with self._cond:
            member = self._members.get(address)
            if member is None or not member.is_leaving or num_in_flight:
                return
            del self._members[address]
        member.stop.set()
        member.client.close()

    def leaving(self) -> list[str]:
        with self._cond:
            return [a for a, m in self._members.items() if m.is_leaving]

    # -- health -----------------------------------------------------------------------------
    def _watch(self, member: Member) -> None:
        stub = health_pb2_grpc.HealthStub(member.client.channel)
        request = health_pb2.HealthCheckRequest(service=VERIFIER_SERVICE)
        while not (self._stop.is_set() or member.stop.is_set()):
            try:
                status = stub.Check(request, timeout=self.cfg.health_timeout_s).status
                is_serving = status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                is_serving = False
            except ValueError:  # the channel was closed under us: the member left
                return
            if is_serving and member.state != SERVING and not member.is_leaving:
                self._learn(member)
                self._set_state(member, SERVING)
            elif not is_serving and member.state != DOWN:
                self._set_state(member, DOWN)
            if member.state == SERVING and time.monotonic() - member.load_at >= self.cfg.load_poll_s:
                self._poll_load(member)
            if self._stop.wait(self.cfg.health_poll_s):
                return

    def _learn(self, member: Member) -> None:
        """Its Info (block size, capacity, load): asked whenever it (re)starts serving."""
        try:
            member.summary = member.client.info(self.cfg.health_timeout_s, [])
            member.block_size = member.summary.kv_block_size
            member.load, member.load_at = member.summary.load, time.monotonic()
        except Exception as exc:  # noqa: BLE001 - routing falls back to the default block size
            log.warning("verifier %s did not answer Info: %s", member.address, exc)

    def _poll_load(self, member: Member) -> None:
        """Asks a serving verifier what it serves (for admission); one that does not say keeps none."""
        capacity = member.summary.kv_capacity_tokens if member.summary is not None else 0
        try:
            load = member.client.load(self.cfg.health_timeout_s, capacity)
        except Exception as exc:  # noqa: BLE001 - its health decides whether it serves
            log.debug("verifier %s did not report its load: %s", member.address, exc)
            load = None
        with self._cond:
            member.load, member.num_mine, member.load_at = load, self._in_flight(member.address), time.monotonic()
        self.on_load()

    def _set_state(self, member: Member, state: str) -> None:
        with self._cond:
            if member.state == state:
                return
            member.state = state
            self._cond.notify_all()
        log.info("verifier %s is %s", member.address, state)
        self._on_change(member.address, state)

    def mark_down(self, address: str) -> None:
        """A call found it unreachable: out of routing until its health says SERVING again."""
        with self._cond:
            member = self._members.get(address)
        if member is not None:
            self._set_state(member, DOWN)

    # -- asking -----------------------------------------------------------------------------
    def members(self) -> list[Member]:
        with self._cond:
            return list(self._members.values())

    def serving(self) -> list[Member]:
        with self._cond:
            return [m for m in self._members.values() if m.state == SERVING and not m.is_leaving]

    def member(self, address: str) -> Member | None:
        with self._cond:
            return self._members.get(address)

    def wait_serving(self, timeout_s: float, avoid: frozenset[str] = frozenset(),
                     while_starting: bool = False) -> list[Member]:
        """The serving members, preferring those not in `avoid`, waiting up to `timeout_s` for one
        outside it (`while_starting`: only while some member's health is still unchecked); []
        when none serves by then."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if all(address in avoid for address in self._members):  # nowhere else to go: any will do
                avoid = frozenset()
            while True:
                serving = [m for m in self._members.values() if m.state == SERVING and not m.is_leaving]
                preferred = [m for m in serving if m.address not in avoid]
                remaining = deadline - time.monotonic()
                is_known = all(m.state != UNKNOWN for m in self._members.values())
                if preferred or remaining <= 0 or (while_starting and is_known):
                    return preferred or serving
                self._cond.wait(remaining)

    def block_size(self, member: Member) -> int:
        return member.block_size or self.cfg.default_block_size

    def close(self) -> None:
        self._stop.set()
        for member in self.members():
            member.stop.set()
        for thread in self._threads:
            thread.join(2.0)
        for member in self.members():
            member.client.close()


class RoutedStream:
    """One routed Verifier.Generate call: iterate for steps (a failed call raises `PeerError`)."""

    def __init__(self, stream: VerifierStream, route: Route, on_unavailable: Callable[[str], None]):
        self._stream = stream
        self.route = route
        self.address = route.address
        self._on_unavailable = on_unavailable

    def __iter__(self) -> Iterator[VerifierStep]:
        try:
            yield from self._stream
        except PeerError as exc:
            if isinstance(exc.cause, UnavailableError):
                self._on_unavailable(self.address)
            raise
        finally:
            self.route.release()

    def cancel(self) -> None:
        self._stream.cancel()


class RoutedVerifiers:
    """The gateway's verifiers behind one client interface: each call routed (see the module doc)."""

    def __init__(self, pool: VerifierPool, router: Router, metrics: GatewayMetrics, route_wait_s: float = ROUTE_WAIT_S):
        self.pool = pool
        self.router = router
        self.metrics = metrics
        self.route_wait_s = route_wait_s

    def _candidates(self, avoid: frozenset[str], wait_s: float) -> list[Member]:
        members = self.pool.wait_serving(wait_s, avoid)
        if not members:
            raise UnavailableError(f"no verifier is serving ({self.pool.targets.describe()})")
        return members

    def generate(self, call: VerifierCall, timeout_s: float, metadata: list[tuple[str, str]],
                 avoid: frozenset[str] = frozenset()) -> RoutedStream:
        """Routes `call` to a serving verifier (not one in `avoid` while another serves);
        UnavailableError when none serves within the route wait (or `timeout_s`)."""
        members = self._candidates(avoid, min(self.route_wait_s, timeout_s))
        by_address = {m.address: m for m in members}
        route = self.router.route(call.prompt_ids, [Candidate(m.address, self.pool.block_size(m)) for m in members],
                                  call.session_id)
        self.metrics.routed_requests.labels(route.address, route.reason).inc()
        self.metrics.routed_prefix_tokens.inc(route.matched_tokens)
        try:
            stream = by_address[route.address].client.generate(call, timeout_s, metadata)
        except BaseException:
            route.release()
            raise
        return RoutedStream(stream, route, self.pool.mark_down)

    def info(self, timeout_s: float, metadata: list[tuple[str, str]]) -> VerifierSummary:
        """A serving verifier's Info (they serve one model); UnavailableError when none serves
        (waiting only while the gateway starts, before every verifier's health was checked once)."""
        members = self.pool.wait_serving(min(self.route_wait_s, timeout_s), while_starting=True)
        if not members:
            raise UnavailableError(f"no verifier is serving ({self.pool.targets.describe()})")
        return members[0].client.info(timeout_s, metadata)

    def release_session(self, session_id: str, timeout_s: float, metadata: list[tuple[str, str]]) -> bool:
        """Frees a session's KV on the verifier it went to (on every serving one when unknown)."""
        address = self.router.forget_affinity(session_id)
        member = self.pool.member(address) if address else None
        targets = [member] if member is not None else self.pool.serving()
        released = False
        for m in targets:
            released = m.client.release_session(session_id, timeout_s, metadata) or released
        return released

    def num_serving(self) -> int:
        return len(self.pool.serving())

    def loads(self) -> list[tuple[VerifierLoad, int]]:
        """Each serving verifier's last report, with this gateway's calls on it when it came."""
        return [(m.load, m.num_mine) for m in self.pool.serving() if m.load is not None]

    def close(self) -> None:
        self.pool.close()
