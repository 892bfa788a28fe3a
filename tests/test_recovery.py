"""Peers that restart are found again, and every server answers reflection v1.

The gateway -> verifier and verifier -> speculator channels cap gRPC's reconnect backoff (its own
grows to minutes), so a restarted peer is tried again within about a second; the tests check the
channels' options and that a peer serving again on the same port is found (requests poll the
stack every 50 ms while it is down). How soon is measured by `scripts/chaos.py`, not here.
"""

from __future__ import annotations

import time

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from services.verifier import speculators
from services.verifier.speculators import RemoteSpeculation
from specinfer.v1 import specinfer_pb2 as pb
from util import start_stack, wait_until

WIDTHS = (1, 1, 3, 1, 1, 1)
POLL_S = 0.05
OUTAGE_S = 3.0  # long enough for gRPC's default backoff (1 s, 1.6 s, 2.6 s ...) to show


def _poll(attempt, seconds: float) -> None:
    """Calls `attempt` every POLL_S for `seconds`, as clients keep coming while a peer is down."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        attempt()
        time.sleep(POLL_S)


def test_the_channels_to_peers_try_a_restarted_peer_again_within_a_second(monkeypatch):
    from services.gateway.verifier_client import VerifierClient

    opened, real = [], grpc.insecure_channel

    def recorded(target, options=None):
        opened.append((real(target, options=options), dict(options or ())))
        return opened[-1][0]

    monkeypatch.setattr(grpc, "insecure_channel", recorded)
    VerifierClient("127.0.0.1:1")  # the gateway's channel to a verifier
    speculators.speculator_stub("127.0.0.1:1")  # the verifier's channel to a speculator
    assert len(opened) == 2
    for channel, options in opened:
        channel.close()
        for name in ("grpc.initial_reconnect_backoff_ms", "grpc.min_reconnect_backoff_ms",
                     "grpc.max_reconnect_backoff_ms"):
            assert 0 < options[name] <= 1000, (name, options)


def test_gateway_reaches_a_restarted_verifier(text_pair):
    from services.verifier.config import VerifierConfig
    from services.verifier.server import build as build_verifier

    llm, ssm = text_pair
    with start_stack(llm, [ssm], tree_width=WIDTHS, gateway={}) as stack:
        request = pb.GenerateRequest(prompt="import os", max_tokens=4)

        def succeeds() -> bool:
            try:
                stack.gateway_stub.Generate(request, timeout=5)
                return True
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                return False

        assert succeeds()
        port = stack.verifier.port
        stack.verifier.stop(0)
        _poll(lambda: assert_false(succeeds()), OUTAGE_S)
        stack.verifier, stack.verifier_servicer = build_verifier(VerifierConfig(
            llm, (f"127.0.0.1:{stack.speculators[0][0].port}",), port=port, device="cpu", grace_s=0,
            tree_width=WIDTHS))
        assert wait_until(succeeds, 30, interval=POLL_S)


def assert_false(value: bool) -> None:
    assert not value


def test_verifier_speculates_again_after_a_speculator_restart(tiny_pair):
    from services.speculator.config import SpeculatorConfig
    from services.speculator.server import build as build_speculator

    with start_stack(tiny_pair.llm, [tiny_pair.ssms[0]], tree_width=WIDTHS, is_load_aware=False,
                     speculator_step_timeout_s=2) as stack:
        def stats() -> pb.GenerationStats:
            last = None
            for last in stack.verifier_stub.Generate(pb.VerifierGenerateRequest(
                    prompt_ids=[3, 4, 5, 6], max_new_tokens=8, speculate=True), timeout=10):
                pass
            return last.stats

        def speculates() -> bool:
            s = stats()
            return not s.fell_back and s.mean_tree_nodes > 1

        assert speculates()
        server, _ = stack.speculators[0]
        port = server.port
        server.stop(0)
        assert stats().fell_back  # the request went on without it
        _poll(stats, OUTAGE_S)
        stack.speculators[0] = build_speculator(SpeculatorConfig((tiny_pair.ssms[0],), port=port, device="cpu",
                                                                 grace_s=0))
        assert wait_until(speculates, 30, interval=POLL_S)


class _FakeSpeculatorStub:
    def __init__(self, answers: list):
        self.answers = answers
        self.num_calls = 0

    def Info(self, request, timeout):
        self.num_calls += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return _Info(answer)


class _Info:
    def __init__(self, names: list[str]):
        self.ssm_names = names


def test_which_ssms_a_speculator_hosts_is_asked_again_after_a_failure_or_a_dropped_stream(monkeypatch):
    speculation = RemoteSpeculation((), vocab_size=8, step_timeout_s=1)
    stub = _FakeSpeculatorStub([grpc.RpcError(), ["a"], ["b"]])
    assert speculation.hosted_names("t", stub) is None  # down at the first ask
    assert speculation.hosted_names("t", stub) is None and stub.num_calls == 1  # not asked on every request
    monkeypatch.setattr(speculators, "SPECULATOR_INFO_RETRY_S", 0.0)
    assert speculation.hosted_names("t", stub) == ("a",)  # asked again once the retry interval passed
    assert speculation.hosted_names("t", stub) == ("a",) and stub.num_calls == 2  # an answer is kept
    link = speculators.SpeculatorLink("t", stub, 1.0, lambda: speculation.forget("t"))
    link.fail("stream ended")  # it may have restarted with other SSMs
    assert speculation.hosted_names("t", stub) == ("b",) and stub.num_calls == 3


def test_every_server_answers_reflection_v1(tiny_pair):
    with start_stack(tiny_pair.llm, [tiny_pair.ssms[0]]) as stack:
        pool = descriptor_pool.Default()  # the server put grpc.reflection.v1's file there
        request_type = message_factory.GetMessageClass(
            pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionRequest"))
        response_type = message_factory.GetMessageClass(
            pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionResponse"))
        for port, service in ((stack.verifier.port, "specinfer.v1.Verifier"),
                              (stack.speculators[0][0].port, "specinfer.v1.Speculator")):
            reflect = stack.channel(port).stream_stream(
                "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                request_serializer=request_type.SerializeToString, response_deserializer=response_type.FromString)
            listed, described = reflect(iter([
                request_type(list_services=""),
                request_type(file_containing_symbol="grpc.reflection.v1.ServerReflection")]), timeout=5)
            names = {s.name for s in listed.list_services_response.service}
            assert {service, "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                    "grpc.reflection.v1alpha.ServerReflection"} <= names
            files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                     for b in described.file_descriptor_response.file_descriptor_proto]
            assert [f.package for f in files] == ["grpc.reflection.v1"]
