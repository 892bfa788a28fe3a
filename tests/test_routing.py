"""Cache-aware routing over several verifiers: the router's picks, the pool's membership.

The router is pure bookkeeping and tested as such; the pool is tested against real gRPC health
servers (and a resolver that answers what the test says), since following health is its job.
"""

from __future__ import annotations

import random
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.gateway import verifier_pool
from services.gateway.routing import (
    AFFINITY, BALANCE, CACHE, Candidate, PrefixIndex, Router, RoutingConfig, block_hashes,
)
from services.gateway.telemetry import GatewayMetrics
from services.gateway.verifier_client import VerifierCall, VerifierClient
from services.gateway.verifier_pool import (
    DOWN, SERVING, PoolConfig, RoutedVerifiers, VerifierPool, VerifierTargets,
)
from specinfer.errors import UnavailableError, UserError
from specinfer.params import GenerationParams
from specinfer.serving.grpc_server import ServerConfig, start_server
from specinfer.serving.metrics import new_registry
from util import wait_until

BS = 16
V0, V1 = Candidate("v0:1", BS), Candidate("v1:1", BS)
SYSTEM_LEN = 1024


def _system_prompts(rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(1000) for _ in range(SYSTEM_LEN)] for _ in range(2)]


def _request(rng: random.Random, system: list[int]) -> list[int]:
    return system + [rng.randrange(1000) for _ in range(rng.randrange(5, 60))]


# -- hashing ------------------------------------------------------------------------------------
def test_block_hashes_chain_over_full_blocks():
    a = list(range(40))
    assert len(block_hashes(a, BS)) == 2  # the partial third block is not hashed
    b = a[:16] + [999] + a[17:]
    ha, hb = block_hashes(a, BS), block_hashes(b, BS)
    assert ha[0] == hb[0] and ha[1] != hb[1]
    c = [7] + a[1:]  # a change in block 0 changes every later hash (a chain), not only block 0's
    assert all(x != y for x, y in zip(block_hashes(c, BS), ha))
    assert block_hashes(a[16:32], BS) != ha[1:2]  # the same tokens after another prefix: another hash


def test_the_prefix_index_is_bounded_and_forgets_the_least_recently_sent():
    index = PrefixIndex(capacity=4)
    index.add([1, 2, 3])
    index.add([4, 5])  # 1 is the oldest: evicted
    assert len(index) == 4 and index.match([1, 2]) == 0 and index.match([2, 3, 4, 5]) == 4
    index.add([2])  # sent again: now the newest
    index.add([6])
    assert index.match([2]) == 1 and index.match([3]) == 0


# -- the router ---------------------------------------------------------------------------------
def _hit_rate(pick, num_requests: int = 400, max_in_flight: int = 6, seed: int = 0) -> float:
    """Two 1k-token system prompts, requests of either in random order, a few in flight at a
    time: the share of requests that land on a verifier whose cache holds their system prompt,
    each cache holding one (the prompt it was sent last: a KV budget of about one system prompt)."""
    rng = random.Random(seed)
    systems = _system_prompts(rng)
    cached: dict[str, int | None] = {V0.address: None, V1.address: None}
    in_flight: list = []
    hits = 0
    for i in range(num_requests):
        group = rng.randrange(2)
        address, release = pick(_request(rng, systems[group]))
        hits += cached[address] == group
        cached[address] = group
        in_flight.append(release)
        if len(in_flight) >= max_in_flight:
            in_flight.pop(rng.randrange(len(in_flight)))()
    return hits / num_requests


def test_requests_go_where_their_prefix_was_sent_far_more_often_than_round_robin():
    router = Router()

    def cache_aware(prompt):
        route = router.route(prompt, [V0, V1])
        return route.address, route.release

    turn = iter(range(10 ** 6))

    def round_robin(prompt):
        return (V0, V1)[next(turn) % 2].address, lambda: None

    rate, baseline = _hit_rate(cache_aware), _hit_rate(round_robin)
    print(f"routing hit rate: cache-aware {rate:.1%}, round robin {baseline:.1%}")
    assert rate >= 0.8 and baseline < 0.65
    assert router.load(V0.address) + router.load(V1.address) == 5  # the requests still in flight
    # both verifiers were used: each prefix found its own home rather than all piling on one
    assert {router.route(_request(random.Random(1), s), [V0, V1]).reason for s in _system_prompts(random.Random(0))} \
        == {CACHE}


def test_a_prompt_with_no_known_prefix_goes_to_the_least_loaded_then_the_emptiest():
    router = Router()
    first = router.route(list(range(64)), [V0, V1])
    assert (first.address, first.reason) == (V0.address, BALANCE)
    second = router.route(list(range(100, 164)), [V0, V1])  # V0 is busier
    assert (second.address, second.reason) == (V1.address, BALANCE)
    first.release(), second.release()
    router.route(list(range(200, 264)), [V1]).release()  # V1 now was sent more blocks than V0
    third = router.route(list(range(300, 364)), [V0, V1])  # equal loads: the one sent less
    assert (third.address, third.reason) == (V0.address, BALANCE)
    third.release()
    assert router.route(list(range(200, 264)) + [5] * 20, [V0, V1]).address == V1.address  # a match wins


def test_load_balancing_takes_over_when_the_verifier_holding_the_prefix_is_too_busy():
    router = Router(RoutingConfig(balance_abs=8, balance_ratio=1.5))
    prompt = list(range(128))
    held = [router.route(prompt, [V0, V1]) for _ in range(9)]  # 1 balance pick, then 8 cache hits on V0
    assert [r.address for r in held] == [V0.address] * 9 and [r.reason for r in held[1:]] == [CACHE] * 8
    # V0 has 9 in flight, V1 none: 9 > 0 + 8 and 9 > 1.5 * 0: the least loaded takes it
    spill = router.route(prompt, [V0, V1])
    assert (spill.address, spill.reason) == (V1.address, BALANCE)
    # now both hold the prompt: of equal matches, the less loaded
    again = router.route(prompt, [V0, V1])
    assert (again.address, again.reason) == (V1.address, CACHE)
    held[0].release()
    held[0].release()  # releasing twice counts once
    assert (router.load(V0.address), router.load(V1.address)) == (8, 2)
    # a longer match on the busier one wins while the imbalance is within bounds (8 vs 2: 8 > 2 + 8 is false)
    router.route(prompt + list(range(1000, 1032)), [V0])  # V0 alone holds a longer prefix (9 in flight)
    longer = router.route(prompt + list(range(1000, 1048)), [V0, V1])
    assert (longer.address, longer.reason) == (V0.address, CACHE)  # 9 > 2 + 8 is false


def test_sessions_and_sample_groups_stick_to_their_verifier_while_it_is_a_candidate():
    router = Router()
    other = list(range(500, 700))
    router.route(other, [V0, V1]).release()  # V0 holds `other`
    first = router.route(list(range(64)), [V1], "session-a")  # the session starts on V1
    assert first.address == V1.address
    again = router.route(other, [V0, V1], "session-a")  # V0 holds this prompt, but the session is on V1
    assert (again.address, again.reason) == (V1.address, AFFINITY)
    moved = router.route(other, [V0], "session-a")  # V1 is gone: the session goes on elsewhere...
    assert moved.address == V0.address
    assert router.route(list(range(64)), [V0, V1], "session-a").address == V0.address  # ...and stays there
    assert router.forget_affinity("session-a") == V0.address and router.affinity("session-a") is None


def test_a_restarted_verifier_is_forgotten():
    router = Router()
    prompt = list(range(64))
    router.route(prompt, [V0, V1]).release()
    router.drop(V0.address)
    route = router.route(prompt, [V0, V1])
    assert route.reason == BALANCE and route.matched_tokens == 0


def test_routing_settings_are_checked():
    with pytest.raises(UserError, match="ratio"):
        RoutingConfig(balance_ratio=0.5)
    with pytest.raises(UserError, match="threshold"):
        RoutingConfig(balance_abs=-1)


# -- the verifier addresses -----------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("a:1", VerifierTargets(addresses=("a:1",))),
    ("a:1, b:2", VerifierTargets(addresses=("a:1", "b:2"))),
    ("[::1]:5", VerifierTargets(addresses=("[::1]:5",))),
    ("dns:///verifier:50052", VerifierTargets(dns_host="verifier", dns_port=50052)),
    ("dns:verifier:7", VerifierTargets(dns_host="verifier", dns_port=7)),
    ("dns:///verifier", VerifierTargets(dns_host="verifier", dns_port=50052)),
])
def test_verifier_addresses_parse(text, expected):
    assert VerifierTargets.parse(text) == expected


@pytest.mark.parametrize("text, message", [
    ("a", "not host:port"), ("a:0", "not in \\[1, 65535\\]"), ("a:1,,b:2", "empty address"),
    ("a:1,a:1", "listed twice"), ("dns://8.8.8.8/v:1", "no DNS server authority"), ("dns:///a:1,b:2", "one name"),
    ("unix:///tmp/s", "host:port addresses"), ("::1:5", "brackets"), ("", "empty address"),
])
def test_bad_verifier_addresses_are_refused_clearly(text, message):
    with pytest.raises(UserError, match=f"^--verifier-addr: .*{message}"):
        VerifierTargets.parse(text)


def test_the_gateway_refuses_a_bad_verifier_address_at_start(tmp_path):
    from services.gateway.config import config_from_args
    from util import add_tokenizer

    add_tokenizer(tmp_path, 300, ["hello world. "] * 20)
    with pytest.raises(UserError, match="SPECINFER_VERIFIER_ADDR.*listed twice"):
        config_from_args(["--model-dir", str(tmp_path)], {"SPECINFER_VERIFIER_ADDR": "a:1,a:1"})
    cfg = config_from_args(["--model-dir", str(tmp_path), "--verifier-addr", "a:1,b:2",
                            "--routing-balance-threshold", "3"], {})
    assert cfg.verifier_targets.addresses == ("a:1", "b:2") and cfg.routing.balance_abs == 3


# -- the pool: membership follows health and DNS ----------------------------------------------------
FAST = PoolConfig(dns_refresh_s=0.05, health_poll_s=0.02, health_timeout_s=0.5)


def _health_server(port: int = 0, host: str = "127.0.0.1"):
    return start_server(ServerConfig(host=host, port=port, grace_s=0), [], ["specinfer.v1.Verifier"])


def _call(prompt, session_id: str = "") -> VerifierCall:
    return VerifierCall("r", tuple(prompt), GenerationParams(max_new_tokens=1), session_id)


@pytest.fixture
def two_verifiers():
    servers = [_health_server(), _health_server()]
    targets = VerifierTargets(addresses=tuple(f"127.0.0.1:{s.port}" for s in servers))
    metrics = GatewayMetrics.create(new_registry())
    router = Router()
    pool = VerifierPool(targets, VerifierClient, FAST, in_flight=router.load)
    pool.start()
    verifiers = RoutedVerifiers(pool, router, metrics, route_wait_s=0.3)
    assert wait_until(lambda: len(pool.serving()) == 2, 5)
    yield servers, verifiers
    verifiers.close()
    for s in servers:
        s.stop(0)


def _route(verifiers: RoutedVerifiers, prompt, avoid=frozenset()) -> str:
    stream = verifiers.generate(_call(prompt), 5.0, [], avoid)
    stream.cancel()
    stream.route.release()
    return stream.address


def test_a_verifier_that_stops_serving_is_never_picked_and_is_picked_again_when_it_serves(two_verifiers):
    servers, verifiers = two_verifiers
    a0, a1 = (f"127.0.0.1:{s.port}" for s in servers)
    prompt = list(range(64))
    assert _route(verifiers, prompt) == a0  # V0 now holds this prompt
    servers[0].set_serving(False)  # draining, say
    assert wait_until(lambda: [m.address for m in verifiers.pool.serving()] == [a1], 5)
    assert {_route(verifiers, prompt) for _ in range(20)} == {a1}
    servers[0].set_serving(True)
    assert wait_until(lambda: len(verifiers.pool.serving()) == 2, 5)
    assert {_route(verifiers, list(range(1000 + 64 * i, 1064 + 64 * i))) for i in range(4)} == {a0, a1}


def test_a_dead_verifier_leaves_at_once_and_one_restarted_on_its_port_comes_back(two_verifiers):
    servers, verifiers = two_verifiers
    a0, a1 = (f"127.0.0.1:{s.port}" for s in servers)
    port = servers[0].port
    servers[0].stop(0)
    assert wait_until(lambda: verifiers.pool.member(a0).state == DOWN, 5)
    assert {_route(verifiers, list(range(64))) for _ in range(10)} == {a1}
    servers[0] = _health_server(port)
    assert wait_until(lambda: verifiers.pool.member(a0).state == SERVING, 5)
    assert _route(verifiers, list(range(64)), avoid=frozenset({a1})) == a0


def test_a_retry_avoids_the_verifier_it_failed_on_unless_it_is_the_only_one(two_verifiers):
    servers, verifiers = two_verifiers
    a0, a1 = (f"127.0.0.1:{s.port}" for s in servers)
    prompt = list(range(64))
    assert _route(verifiers, prompt) == a0
    assert _route(verifiers, prompt, avoid=frozenset({a0})) == a1  # although a0 holds the prefix
    assert _route(verifiers, prompt, avoid=frozenset({a0, a1})) in (a0, a1)  # nowhere else: any serving one


def test_with_no_verifier_serving_a_call_waits_the_route_wait_for_one_then_fails_unavailable(two_verifiers):
    servers, verifiers = two_verifiers
    a1 = f"127.0.0.1:{servers[1].port}"
    for s in servers:
        s.set_serving(False)
    assert wait_until(lambda: not verifiers.pool.serving(), 5)
    cond, is_waiting = verifiers.pool._cond, threading.Event()
    wait = cond.wait
    cond.wait = lambda timeout=None: is_waiting.set() or wait(timeout)
    # The futures' timeouts guard hangs only: waiting for the call's timeout (an hour) or for a
    # route wait of an hour that no serving verifier ends would hang.
    with ThreadPoolExecutor(1) as pool:
        try:
            with pytest.raises(UnavailableError, match="no verifier is serving"):  # the route wait (0.3 s) ends it
                pool.submit(verifiers.generate, _call(range(16)), 3600.0, []).result(timeout=30)
            assert is_waiting.is_set()  # it did wait for one
            verifiers.route_wait_s, is_waiting = 3600.0, threading.Event()
            routed = pool.submit(_route, verifiers, list(range(16)))
            assert is_waiting.wait(30) and not routed.done()
            servers[1].set_serving(True)  # one serves again during the wait: it takes the call
            assert routed.result(timeout=30) == a1
        finally:
            servers[1].set_serving(True)  # ends any wait still going (the pool waits for it)


def test_a_dns_name_is_resolved_to_every_address_again_and_again(monkeypatch):
    servers = [_health_server(host="0.0.0.0")]
    answer = {"ports": [servers[0].port]}

    def getaddrinfo(host, port, type=0):
        assert host == "verifier.example"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (f"127.0.0.{i + 1}", port))
                for i in range(len(answer["ports"]))]

    # every replica listens on the same port under one name; here they are 127.0.0.1 and 127.0.0.2
    monkeypatch.setattr(verifier_pool.socket, "getaddrinfo", getaddrinfo)
    targets = VerifierTargets.parse("dns:///verifier.example:%d" % servers[0].port)
    pool = VerifierPool(targets, VerifierClient, FAST)
    try:
        pool.start()
        assert wait_until(lambda: [m.address for m in pool.serving()] == [f"127.0.0.1:{servers[0].port}"], 5)
        answer["ports"] = [servers[0].port] * 2  # a second replica appears under the name
        assert wait_until(lambda: len(pool.serving()) == 2, 5)
        answer["ports"] = [servers[0].port]  # and goes again: it leaves routing, then its channel closes
        assert wait_until(lambda: len(pool.members()) == 1 and len(pool.serving()) == 1, 5)
    finally:
        pool.close()
        for s in servers:
            s.stop(0)


def test_prompts_too_short_to_leave_a_trace_take_turns():
    router = Router()
    picks = []
    for i in range(6):  # one after the other: equal loads, nothing cached anywhere
        route = router.route([i] * 5, [V0, V1])
        picks.append(route.address)
        route.release()
    assert picks == [V0.address, V1.address] * 3
