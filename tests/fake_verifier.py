"""A fake Verifier gRPC service for gateway tests: deterministic tokens, recorded calls.

Each step emits `tokens_per_step` tokens after `delay_s`; the next token is `successor(prev)`,
a function of the previous token only, so a continuation from (prompt + tokens so far) yields
exactly the tokens an uninterrupted call would have (like greedy decoding). A call of n > 1
samples (`num_samples`) steps them together, each message naming its sample, each sample seeded
as the verifier seeds it (`sample_seed`). Every call records
what the gateway sent (prompt ids, limits, deadline, trace metadata) and how it ended.
`refuse(request)` may return a message: the call then fails with INVALID_ARGUMENT, as the real
verifier refuses what only it can check (a schema that does not compile, a token outside the
vocabulary).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from specinfer.params import sample_seed
from specinfer.serving.grpc_server import RunningServer, ServerConfig, start_server
from specinfer.v1 import specinfer_pb2 as pb
from specinfer.v1 import specinfer_pb2_grpc as pb_grpc


def cycle_successor(script: list[int]) -> Callable[[int], int]:
    """next(t) = the token after t in `script` (cyclically); script[0] after any other token."""
    index = {t: i for i, t in enumerate(script)}
    assert len(index) == len(script), "script tokens must be distinct"
    return lambda t: script[(index[t] + 1) % len(script)] if t in index else script[0]


def expected_tokens(successor: Callable[[int], int], last_prompt_token: int, n: int) -> list[int]:
    out, prev = [], last_prompt_token
    for _ in range(n):
        prev = successor(prev)
        out.append(prev)
    return out


@dataclass
class FakeCall:
    request: pb.VerifierGenerateRequest
    time_remaining: float | None
    metadata: dict
    is_finished: bool = False  # emitted everything it was asked for
    num_sent: int = 0
    _ended: threading.Event = field(default_factory=threading.Event, init=False, repr=False, compare=False)

    @property
    def is_cancelled(self) -> bool:
        return self._ended.is_set() and not self.is_finished

    def end(self) -> None:
        self._ended.set()

    def wait_ended(self, timeout_s: float) -> bool:
        return self._ended.wait(timeout_s)


class FakeVerifier(pb_grpc.VerifierServicer):
    def __init__(self, successor: Callable[[int], int], *, tokens_per_step: int = 2, delay_s: float = 0.01,
                 vocab_size: int = 512, model: str = "fake-llm", max_context: int = 4096):
        self.successor = successor
        self.tokens_per_step = tokens_per_step
        self.delay_s = delay_s
        self.vocab_size = vocab_size
        self.model = model
        self.max_context = max_context
        self.calls: list[FakeCall] = []
        self.released: list[str] = []
        self.refuse: Callable[[pb.VerifierGenerateRequest], str | None] = lambda request: None
        # Set: the next token is seeded_successor(previous token, the sample's seed), so samples
        # (and requests) with different seeds differ, as sampled LLM output does.
        self.seeded_successor: Callable[[int, int], int] | None = None
        self.load = pb.VerifierLoad()  # what Load reports (a test sets capacity and measured pace)
        self._lock = threading.Lock()
        self._called = threading.Condition(self._lock)  # notified on every new call

    def reset(self, *, delay_s: float = 0.01, tokens_per_step: int = 2) -> None:
        with self._lock:
            self.calls.clear()
            self.released.clear()
        self.refuse = lambda request: None
        self.seeded_successor = None
        self.load = pb.VerifierLoad()
        self.delay_s, self.tokens_per_step = delay_s, tokens_per_step

    def wait_for_calls(self, n: int, timeout_s: float = 2.0) -> list[FakeCall]:
        with self._called:
            self._called.wait_for(lambda: len(self.calls) >= n, timeout_s)
            return list(self.calls)

    def Generate(self, request, context):
        remaining = context.time_remaining()
        call = FakeCall(request, remaining, dict(context.invocation_metadata() or ()))
        with self._called:
            self.calls.append(call)
            self._called.notify_all()
        context.add_callback(call.end)
        refusal = self.refuse(request)
        if refusal:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal)
        yield from self._samples(call, request, context)

    def _samples(self, call: FakeCall, request, context):
        """Every sample of the call steps together, one message per sample and step (as the
        verifier's samples share each pass); a call of one sample is sample 0."""
        num = max(1, request.num_samples)
        progress = [(s.index, list(s.token_ids)) for s in request.samples] or [(i, []) for i in range(num)]
        seed = request.sampling.seed if request.sampling.HasField("seed") else 0
        live = {i: {"prev": (list(request.prompt_ids) + done)[-1], "n": 0, "steps": 0,
                    "max": request.max_new_tokens - len(done),
                    "next": self._successor(sample_seed(seed, i))} for i, done in progress}
        while live:
            time.sleep(self.delay_s)
            if not context.is_active():
                return
            for i, sample in list(live.items()):
                ids = []
                for _ in range(min(self.tokens_per_step, sample["max"] - sample["n"])):
                    sample["prev"] = sample["next"](sample["prev"])
                    ids.append(sample["prev"])
                sample["n"], sample["steps"] = sample["n"] + len(ids), sample["steps"] + 1
                n, steps = sample["n"], sample["steps"]
                call.num_sent += len(ids)
                if n < sample["max"]:
                    yield pb.VerifierGenerateResponse(token_ids=ids, sample_index=i)
                    continue
                del live[i]
                call.is_finished = not live
                stats = pb.GenerationStats(prompt_tokens=len(request.prompt_ids), output_tokens=n, llm_steps=steps,
                                           tokens_per_step=n / steps, mean_accepted=n / steps - 1,
                                           mean_tree_nodes=4.0, acceptance_rate=(n / steps - 1) / 3)
                yield pb.VerifierGenerateResponse(token_ids=ids, finish_reason="length", stats=stats, sample_index=i)

    def _successor(self, seed: int) -> Callable[[int], int]:
        if self.seeded_successor is None:
            return self.successor
        return lambda t: self.seeded_successor(t, seed)

    def ReleaseSession(self, request, context):
        self.released.append(request.session_id)
        return pb.ReleaseSessionResponse(released=True)

    def Load(self, request, context):
        return self.load

    def Info(self, request, context):
        return pb.VerifierInfo(model=self.model, vocab_size=self.vocab_size, max_context=self.max_context,
                               default_shape=pb.TreeShape(widths=[1, 1, 3, 1], max_nodes=64), num_speculators=2,
                               kv_capacity_tokens=65536, load=self.load)


def start_fake_verifier(fake: FakeVerifier, port: int = 0) -> RunningServer:
    return start_server(ServerConfig(port=port, max_workers=32, grace_s=0.0),
                        [lambda server: pb_grpc.add_VerifierServicer_to_server(fake, server)],
                        ["specinfer.v1.Verifier"])
