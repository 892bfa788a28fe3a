"""The gateway's client for the Verifier service: one outbound Generate stream per request.

One client per verifier address (`verifier_pool.py` makes one for each, and routes between
them). Calls never use wait_for_ready, so a verifier that is down fails the call at once
(UNAVAILABLE), and reconnect backoff is capped (`reconnect_options`) so a restarted verifier is
found again within about a second.
gRPC errors are turned into the project's domain errors here, at the edge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import grpc

from specinfer.errors import CapacityError, NotFoundError, PeerError, UnavailableError, UserError
from specinfer.logprobs import TokenLogprob
from specinfer.params import GenerationParams, SampleProgress
from specinfer.serving import convert
from specinfer.serving.capacity import VerifierLoad
from specinfer.limits import DEFAULT_MAX_MESSAGE_BYTES
from specinfer.serving.security import ChannelSecurity, open_channel
from specinfer.serving.settings import message_options, reconnect_options
from specinfer.stats import GenerationStats
from specinfer.v1 import specinfer_pb2 as pb
from specinfer.v1 import specinfer_pb2_grpc as pb_grpc

# A call that failed with one of these may be made again later: the request stays resumable.
RESUMABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                             grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED})

@dataclass(frozen=True)
class VerifierCall:
    request_id: str
    prompt_ids: tuple[int, ...]  # everything the LLM has to attend to: context plus tokens so far
    params: GenerationParams  # max_new_tokens: the tokens still to generate; the seed: this call's
    session_id: str = ""
    # With params.num_samples > 1: the samples still to generate, each with its tokens so far
    # (then `prompt_ids` and max_new_tokens are the request's own); empty: every sample, fresh.
    samples: tuple[SampleProgress, ...] = ()


@dataclass(frozen=True)
class VerifierStep:
    token_ids: tuple[int, ...]
    finish_reason: str = ""
    stats: GenerationStats | None = None  # the verifier's measurement, on its last message
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when asked for
    logprob_space: str = ""
    cached_prompt_tokens: int = 0
    sample_index: int = 0  # the sample of an n > 1 call these tokens belong to


@dataclass(frozen=True)
class VerifierSummary:
    model: str
    vocab_size: int
    max_context: int
    default_widths: tuple[int, ...]
    default_max_nodes: int
    num_speculators: int
    ssm_names: tuple[str, ...] = ()
    kv_capacity_tokens: int = 0  # 0 = unknown
    kv_block_size: int = 0  # 0 = unknown
    load: VerifierLoad | None = None  # what it serves now; None: not reported


def domain_error(exc: grpc.RpcError, what: str = "verifier") -> Exception:
    """Maps a downstream gRPC status to the domain error that maps back to the same status."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = f"{what}: {exc.details() if hasattr(exc, 'details') else exc}"
    if code == grpc.StatusCode.UNAVAILABLE:
        return UnavailableError(details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError(details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return UserError(details)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFoundError(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return CapacityError(details)
    return RuntimeError(f"{details} ({code.name})")


def peer_error(exc: grpc.RpcError) -> PeerError:
    """A failed stream's status as a domain error, and whether the request may resume."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    return PeerError(domain_error(exc), code in RESUMABLE_CODES)


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, tls_name: str | None = None
                    ) -> list[tuple[str, object]]:
    """One verifier's channel; `tls_name`: the name its certificate carries when `target` is an
    address resolved from it."""
    options = message_options(max_message_bytes) + reconnect_options()
    if tls_name:
        options.append(("grpc.ssl_target_name_override", tls_name))
    return options


class VerifierStream:
    """One running Verifier.Generate call: iterate for steps, `cancel()` from any thread."""

    def __init__(self, call):
        self._call = call
        self._is_cancelled = False  # by this side (`cancel`): a CANCELLED status is then its own

    def __iter__(self) -> Iterator[VerifierStep]:
        """The verified steps; a failed call raises a `PeerError`. A call the verifier ended with
        CANCELLED, which this side did not cancel, raises it as unavailable: the verifier is
        stopping (its server ends the streams a drain left), so the request goes on elsewhere."""
        try:
            for msg in self._call:
                yield VerifierStep(tuple(msg.token_ids), msg.finish_reason,
                                   convert.stats_from_proto(msg.stats) if msg.HasField("stats") else None,
                                   convert.logprobs_from_proto(msg.logprobs),
                                   convert.space_from_proto(msg.logprob_space), int(msg.cached_prompt_tokens),
                                   int(msg.sample_index))
        except grpc.RpcError as exc:
            if getattr(exc, "code", lambda: None)() == grpc.StatusCode.CANCELLED and not self._is_cancelled:
                details = exc.details() if hasattr(exc, "details") else exc
                raise PeerError(UnavailableError(f"verifier: ended the call ({details})"), True) from exc
            raise peer_error(exc) from exc

    def cancel(self) -> None:
        self._is_cancelled = True
        self._call.cancel()


class VerifierClient:
    def __init__(self, target: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 security: ChannelSecurity | None = None, tls_name: str | None = None):
        self.target = target
        self.channel = open_channel(target, security, channel_options(max_message_bytes, tls_name))
        self.stub = pb_grpc.VerifierStub(self.channel)

    def generate(self, call: VerifierCall, timeout_s: float, metadata: list[tuple[str, str]]) -> VerifierStream:
        request = convert.verifier_request_to_proto(call.request_id, call.prompt_ids, call.params, call.session_id,
                                                    call.samples)
        return VerifierStream(self.stub.Generate(request, timeout=timeout_s, metadata=metadata))

    def release_session(self, session_id: str, timeout_s: float, metadata: list[tuple[str, str]]) -> bool:
        try:
            resp = self.stub.ReleaseSession(pb.ReleaseSessionRequest(session_id=session_id),
                                            timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            raise domain_error(exc) from exc
        return resp.released

    def info(self, timeout_s: float, metadata: list[tuple[str, str]]) -> VerifierSummary:
        try:
            msg = self.stub.Info(pb.InfoRequest(), timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            raise domain_error(exc) from exc
        ssm_names = tuple(msg.ssm_names)
        load = convert.load_from_proto(msg.load, msg.kv_capacity_tokens) if msg.HasField("load") else None
        return VerifierSummary(msg.model, msg.vocab_size, msg.max_context, tuple(msg.default_shape.widths),
                               msg.default_shape.max_nodes, msg.num_speculators, ssm_names,
                               msg.kv_capacity_tokens, msg.kv_block_size, load)

    def load(self, timeout_s: float, kv_capacity_tokens: int) -> VerifierLoad | None:
        """What it serves now; None from a verifier that does not report it (UNIMPLEMENTED)."""
        try:
            msg = self.stub.Load(pb.InfoRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise domain_error(exc) from exc
        return convert.load_from_proto(msg, kv_capacity_tokens)

    def close(self) -> None:
        self.channel.close()
