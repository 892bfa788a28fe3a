"""The verifier's side of the per-request bidirectional streams to speculator services.

Each request opens one stream per speculator: a `start`, then one feedback (accepted tokens plus
the bonus token) per tree asked; each message is answered with the next token tree, in order. A
step waits for a speculator's tree at most a deadline from that speculator's own recent pace;
one that is late does not hold the step up: the step goes on with the other speculators' trees
(merged, Section 3.2), or with incremental decoding (a root-only tree), and the
late speculator's trees are used again as soon as it answers in time. Trees never change what
the LLM outputs, so a late tree costs speed only. A speculator whose stream fails, or that owes
an answer for longer than the step timeout, is dropped for the rest of the request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import replace
from functools import partial
from typing import Callable

import grpc

from specinfer.engine.llm_engine import LocalSpeculation
from specinfer.engine.loop import DraftTree
from specinfer.engine.drafting.speculator import Speculator
from specinfer.engine.drafting.tree import TokenTree, merge_trees
from specinfer.errors import UserError
from specinfer.params import GenerationParams, TreeBudget, TreeShape
from specinfer.serving.convert import budget_to_proto, sampling_to_proto, shape_to_proto
from specinfer.limits import (
    DEFAULT_MAX_MESSAGE_BYTES, SPECULATOR_DEADLINE_FACTOR, SPECULATOR_DEADLINE_FLOOR_S,
    SPECULATOR_INFO_RETRY_S, SPECULATOR_LATENCY_PERCENTILE, SPECULATOR_LATENCY_WINDOW, SUFFIX_CACHE_TOKENS,
)
from specinfer.serving.security import ChannelSecurity, open_channel
from specinfer.serving.settings import message_options, reconnect_options
from specinfer.serving.tracing import outgoing_metadata
from specinfer.serving.trees import tree_from_proto
from specinfer.v1 import specinfer_pb2 as pb
from specinfer.v1 import specinfer_pb2_grpc as pb_grpc
from specinfer.engine.runtime.assemble import model_free_members
from specinfer.engine.runtime.dtype_choice import load_ssm
from specinfer.engine.runtime.load import split_pool

log = logging.getLogger(__name__)
_CLOSED = object()


def speculator_stub(target: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                    security: ChannelSecurity | None = None) -> pb_grpc.SpeculatorStub:
    """A stub on its own channel: TLS and the internal token as `security` says."""
    options: list[tuple[str, object]] = message_options(max_message_bytes) + reconnect_options()
    if target.startswith("dns:"):  # several replicas behind one DNS name: spread requests
        options.append(("grpc.lb_policy_name", "round_robin"))
    return pb_grpc.SpeculatorStub(open_channel(target, security, options))


class SpeculatorPace:
    """How long a step waits for a speculator's next tree: from its own recent answer latencies.

    A step that waits at most a small multiple of what the speculator usually takes loses little
    to a speculator that stalls: it goes on without that tree (plain decoding, or the other
    speculators' trees) instead of waiting out the stall."""

    def __init__(self):
        self.latencies: deque[float] = deque(maxlen=SPECULATOR_LATENCY_WINDOW)

    def observe(self, seconds: float) -> None:
        self.latencies.append(seconds)

    def allowance(self, step_timeout_s: float) -> float:
        """Seconds after its message that an answer is still in time; the step timeout while
        nothing is known of this speculator's pace."""
        if not self.latencies:
            return step_timeout_s
        ordered = sorted(self.latencies)
        usual = ordered[int(SPECULATOR_LATENCY_PERCENTILE * (len(ordered) - 1))]
        return min(step_timeout_s, SPECULATOR_DEADLINE_FACTOR * usual + SPECULATOR_DEADLINE_FLOOR_S)


class SpeculatorLink:
    """One request's stream to one speculator, in lockstep: each message (the start, then one
    feedback per tree asked) gets one answer, in order.

    A step waits for the answer to its own message until the message is `allowance` old. An
    answer not there by then is late, not lost: the link still owes it, and it is dropped when
    it comes. While it is owed the link sends nothing; the tokens verified meanwhile go out
    together with the next message after it came (the speculator maps them onto the tree it
    built last, used or not), so a speculator that is behind never has more than one message to
    answer. A link that owes an answer for longer than the step timeout, or whose stream fails,
    is dropped for the rest of the request."""

    def __init__(self, name: str, stub: pb_grpc.SpeculatorStub, timeout_s: float,
                 on_fail: Callable[[], None] | None = None):
        self.name = name
        self.is_alive = True
        self.is_owing = False  # the last message has not been answered yet
        self.is_late = False  # the last step went on without this link's tree
        self.is_catching_up = False  # the last message told the tokens of steps it was not asked for
        self.pace = SpeculatorPace()
        self._on_fail = on_fail  # told once, when the link is dropped
        self._stub = stub
        self._timeout_s = timeout_s
        self._outbox: queue.Queue = queue.Queue()
        self._inbox: queue.Queue = queue.Queue()
        self._call = None
        self._num_sent = 0  # messages sent; the speculator numbers its answers from 0
        self._sent_at = 0.0  # when the last message went out (time.monotonic)
        self._held: list[int] = []  # verified tokens not sent while an answer was owed
        self.last_levels = 0  # SSM levels of the tree received last

    def open(self, start: pb.SpeculateStart, metadata: list[tuple[str, str]]) -> None:
        """Starts the stream with its first message; the answer is the first tree."""
        self._send(pb.SpeculateRequest(start=start))
        self._call = self._stub.Speculate(iter(self._outbox.get, _CLOSED), timeout=self._timeout_s, metadata=metadata)
        threading.Thread(target=self._read, daemon=True, name=f"spec-link-{self.name}").start()

    def _read(self) -> None:
        try:
            for response in self._call:
                self._inbox.put((response, time.monotonic()))
        except grpc.RpcError as exc:
            self._inbox.put(exc)
        finally:
            self._inbox.put(_CLOSED)

    def _send(self, request: pb.SpeculateRequest) -> None:
        self._outbox.put(request)
        self._num_sent += 1
        self._sent_at = time.monotonic()
        self.is_owing = True

    def offer(self, verified: list[int], max_depth: int, step_timeout_s: float, shape: pb.TreeShape | None = None,
              budget: pb.TreeBudget | None = None) -> bool:
        """Asks for the next tree, telling the tokens verified since the last message (the last
        one is the bonus, the root of the next tree). A link that still owes its last answer is
        not asked: it keeps the tokens for its next message. Returns whether it was asked (False
        also when it is dropped now)."""
        if self.is_owing:
            try:
                self.poll(step_timeout_s)
            except (TimeoutError, ConnectionError):
                return False
            if self.is_owing:
                self._held.extend(verified)
                return False
        self.is_catching_up = bool(self._held)
        tokens, self._held = self._held + verified, []
        feedback = pb.SpeculateFeedback(accepted=tokens[:-1], bonus=tokens[-1], max_depth=max_depth)
        if shape is not None:
            feedback.shape.CopyFrom(shape)
        if budget is not None:
            feedback.budget.CopyFrom(budget)
        self._send(pb.SpeculateRequest(feedback=feedback))
        return True

    def next_tree(self, step_timeout_s: float, vocab_size: int) -> TokenTree | None:
        """The answer to the last message, or None when it is late (still owed); raises (and
        marks the link dead) on any failure. The first answer of a stream prefills the SSMs on
        the whole context: it may take the whole step timeout."""
        allowance = step_timeout_s if self._num_sent == 1 else self.pace.allowance(step_timeout_s)
        response = self._receive(self._sent_at + allowance - time.monotonic())
        if response is None:
            self._check_owed(step_timeout_s, is_due=allowance >= step_timeout_s)
            self._mark_late(True, allowance)
            return None
        self._mark_late(False, allowance)
        self.last_levels = int(response.ssm_levels)
        try:
            return tree_from_proto(response.tree, vocab_size)
        except ValueError as exc:
            self.fail(f"sent an invalid tree: {exc}")
            raise

    def poll(self, step_timeout_s: float) -> None:
        """Takes a late answer that came meanwhile (it is stale: its step is verified); raises (and
        marks the link dead) once an answer is owed for longer than the step timeout."""
        if self._receive(0.0) is None:
            self._check_owed(step_timeout_s)

    def _receive(self, timeout_s: float) -> pb.SpeculateResponse | None:
        """The owed answer if it comes within `timeout_s` (None: still owed); raises on a failure."""
        try:
            item = self._inbox.get(timeout=timeout_s) if timeout_s > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None
        if not isinstance(item, tuple):
            self.fail(f"stream ended: {item if item is not _CLOSED else 'closed'}")
            raise ConnectionError(f"speculator {self.name} stream ended")
        response, received_at = item
        if response.step != self._num_sent - 1:
            self.fail(f"answered message {response.step}, expected {self._num_sent - 1}")
            raise ConnectionError(f"speculator {self.name} answered out of order")
        self.is_owing = False
        if self._num_sent > 1:  # the first answer prefills the SSMs: not the pace of a step
            self.pace.observe(received_at - self._sent_at)
        return response

    def _check_owed(self, step_timeout_s: float, is_due: bool = False) -> None:
        """Drops the link once its answer is owed for the step timeout (`is_due`: it was waited for that long)."""
        owed_s = time.monotonic() - self._sent_at
        if self.is_owing and (is_due or owed_s >= step_timeout_s):
            self.fail(f"no tree for {owed_s:.1f}s")
            raise TimeoutError(f"speculator {self.name} timed out")

    def _mark_late(self, is_late: bool, allowance: float) -> None:
        if is_late != self.is_late:
            if is_late:
                log.info("speculator %s late (no tree within %.0f ms): steps go on without it until it answers "
                         "in time", self.name, 1000 * allowance)
            else:
                log.info("speculator %s answers in time again", self.name)
        self.is_late = is_late

    def fail(self, reason: str) -> None:
        if self.is_alive:
            log.warning("dropping speculator %s for this request: %s", self.name, reason)
            if self._on_fail is not None:
                self._on_fail()
        self.is_alive = False
        if self._call is not None:
            self._call.cancel()

    def close(self) -> None:
        """Ends the stream politely (done=True); a dead link's call is already cancelled."""
        if self.is_alive:
            self._outbox.put(pb.SpeculateRequest(feedback=pb.SpeculateFeedback(done=True)))
        self._outbox.put(_CLOSED)
        self.is_alive = False


def gather_tree(links: list[SpeculatorLink], asked: list[SpeculatorLink], root: int, step_timeout_s: float,
                vocab_size: int, max_nodes: int) -> tuple[TokenTree, list[str], list[str]]:
    """Merges the trees of the live links asked for this step that answer in time; returns it, the
    names of links that failed now and those of live links whose tree this step goes without.

    Each asked link is waited for until its own answer is due, so the step waits for the latest
    due time at most. A tree over `max_nodes` breaks the contract (the verifier reserved KV for
    that many per speculator), so its speculator is dropped."""
    trees, failed, late = [], [], []
    for link in links:
        if not link.is_alive:
            continue
        try:
            if link not in asked:  # behind: it still owes an earlier answer
                link.poll(step_timeout_s)
                late.append(link.name)
                continue
            tree = link.next_tree(step_timeout_s, vocab_size)
        except (TimeoutError, ConnectionError, ValueError):
            failed.append(link.name)
            continue
        if tree is None:
            late.append(link.name)
            continue
        if tree.tokens[0] != root or len(tree) > max_nodes:
            link.fail("tree root is not the last verified token" if tree.tokens[0] != root else "tree too large")
            failed.append(link.name)
            continue
        trees.append(tree)
    if not trees:
        return TokenTree.with_root(root), failed, late
    return (trees[0] if len(trees) == 1 else merge_trees(trees)[0]), failed, late


class RemoteSpeculation:
    """The speculator services a verifier streams trees from (a `DraftSource` of the engine)."""

    def __init__(self, targets: tuple[str, ...], vocab_size: int, step_timeout_s: float,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, security: ChannelSecurity | None = None):
        self.speculators = [(target, speculator_stub(target, max_message_bytes, security)) for target in targets]
        self.vocab_size = vocab_size
        self.step_timeout_s = step_timeout_s
        # target -> (the SSMs it hosts, or None: it could not be asked; when it was asked)
        self._hosted: dict[str, tuple[tuple[str, ...] | None, float]] = {}
        self._lock = threading.Lock()

    def hosted_names(self, target: str, stub) -> tuple[str, ...] | None:
        """The SSMs a speculator hosts; None while it cannot be asked. An answer is kept until a
        stream to that speculator fails (it may come back with other SSMs); a failure to answer
        only for SPECULATOR_INFO_RETRY_S, so a speculator that was down is found again."""
        with self._lock:
            known = self._hosted.get(target)
        if known is not None and (known[0] is not None or time.monotonic() - known[1] < SPECULATOR_INFO_RETRY_S):
            return known[0]
        try:
            names: tuple[str, ...] | None = tuple(stub.Info(pb.InfoRequest(), timeout=1.0).ssm_names)
        except grpc.RpcError:
            names = None
        with self._lock:
            self._hosted[target] = (names, time.monotonic())
        return names

    def forget(self, target: str) -> None:
        """Drops what a speculator was known to host: it is asked again next time."""
        with self._lock:
            self._hosted.pop(target, None)

    def all_names(self) -> list[str]:
        names = []
        for target, stub in self.speculators:
            names += list(self.hosted_names(target, stub) or ())  # one that is down adds no names
        return names

    def chosen(self, ssm_names: tuple[str, ...]) -> list[tuple[str, object]]:
        """The speculators serving a request's SSM pool (all of them for the default pool)."""
        if not ssm_names:
            return self.speculators
        chosen, hosted_all = [], set()
        for target, stub in self.speculators:
            hosted = self.hosted_names(target, stub)
            if hosted is None or set(hosted) & set(ssm_names):
                chosen.append((target, stub))
            hosted_all |= set(hosted or ())
        unknown = [n for n in ssm_names if n not in hosted_all]
        if unknown and all(self.hosted_names(t, s) is not None for t, s in self.speculators):
            raise UserError(f"ssm_names: no speculator hosts {', '.join(unknown)}")
        return chosen

    def num_sources(self, ssm_names: tuple[str, ...]) -> int:
        return len(self.chosen(ssm_names))

    def max_draft_nodes(self, ssm_names: tuple[str, ...], shape: TreeShape, max_dynamic_nodes: int | None = None
                        ) -> int:
        """Nodes beyond the root a step's merged tree may hold: each speculator's tree (model-free
        drafts included) has at most `shape.max_nodes` nodes, root included, or, dynamic, at most
        `max_dynamic_nodes` beyond its root."""
        per_source = shape.max_nodes - 1 if max_dynamic_nodes is None else max(shape.max_nodes - 1, max_dynamic_nodes)
        return self.num_sources(ssm_names) * per_source

    def drafts(self, request_id: str, prompt_ids: list[int], params: GenerationParams, shape: TreeShape,
               timeout_s: float | None) -> "SpeculationDriver":
        speculators = self.chosen(params.ssm_names)
        sampling = sampling_to_proto(params.sampling)
        metadata = outgoing_metadata()  # the request's trace context, taken on its own thread

        def open_links(start: pb.SpeculateStart) -> list[SpeculatorLink]:
            start.request_id = request_id
            start.sampling.CopyFrom(sampling)
            start.ssm_names.extend(params.ssm_names)
            links = [SpeculatorLink(target, stub, timeout_s, partial(self.forget, target))
                     for target, stub in speculators]
            for link in links:
                link.open(start, metadata)
            return links

        return SpeculationDriver(open_links, prompt_ids, shape, self.vocab_size, self.step_timeout_s)


class SpeculationDriver:
    """One request's trees from the speculator services, across steps (the engine's `Drafts`).

    Streams to the speculators open only when the first tree is wanted, so a request that never
    speculates costs the speculators nothing. A step that should not speculate asks nothing; the
    tokens it verifies reach the speculators with the next request for a tree (their caches
    catch up then), so switching speculation off and on costs no extra round trip. A step asks for
    a tree of fixed widths, or for a dynamic tree within a budget: each speculator then decides
    which of its members draft (its SSMs may sit a step out) and reports the SSM levels it ran.
    """

    def __init__(self, open_links, context_ids: list[int], shape: TreeShape, vocab_size: int, step_timeout_s: float):
        self.open_links = open_links  # (start message) -> links
        self.links: list[SpeculatorLink] = []
        self.history = list(context_ids)  # every verified token so far, prompt included
        self.shape = shape
        self.vocab_size = vocab_size
        self.step_timeout_s = step_timeout_s
        self.unsent: list[int] = []  # verified tokens the open streams have not been told about
        self.is_awaiting = False
        self.asked_depth = 0
        self.num_unsent_steps = 0  # verified steps whose tokens the streams have not been told about
        # Whether the tree asked last costs what a steady step costs: an SSM tree right after one
        # (not the first, which prefills the SSMs on the whole context, nor one after plain steps or
        # steps the SSMs sat out, whose tokens they catch up on first).
        self.is_steady = False
        self._is_ssm_current = False  # the SSMs built the tree asked last
        self._is_dynamic = False  # the tree asked last is a dynamic one
        self._has_ever_run_ssm = False  # a dynamic tree's SSMs have read the prompt
        self._max_nodes = shape.max_nodes  # the bound of one speculator's tree asked last
        self.asked: list[SpeculatorLink] = []  # the links asked for the tree asked last
        self._dropped: list[str] = []  # links dropped while the tree was asked (reported with it)

    @property
    def is_usable(self) -> bool:
        return not self.links or any(link.is_alive for link in self.links)

    def ask(self, widths: tuple[int, ...], max_depth: int | None = None, budget: TreeBudget | None = None) -> None:
        """Requests the next tree (opening the streams with the whole context the first time):
        `widths` for the SSMs, whose model-free members draft `max_depth` deep (at least the
        widths' depth), or a dynamic tree within `budget`."""
        if not (widths or budget is not None) or not self.is_usable:
            return
        depth = max(len(widths), max_depth or 0)
        # A dynamic ask keeps the request's shape: its sampling settings hold for the drafts.
        shape = shape_to_proto(replace(self.shape, widths=widths) if widths else self.shape)
        wire_budget = budget_to_proto(budget) if budget is not None else None
        self._is_dynamic = budget is not None
        self._max_nodes = budget.max_nodes + 1 if budget is not None else self.shape.max_nodes
        # For a dynamic tree, whether its SSMs ran is known once it is in (`tree`); its SSMs' first
        # pass reads the tokens of the steps they sat out, one pass of whatever length.
        is_steady = self._is_dynamic or (self._is_ssm_current and self.num_unsent_steps == 1)
        if not self._is_dynamic:
            is_steady, self._is_ssm_current = is_steady and bool(widths), bool(widths)
        if not self.links:
            start = pb.SpeculateStart(context_ids=self.history, shape=shape, max_depth=depth, budget=wire_budget)
            self.links = self.asked = self.open_links(start)
            is_steady = False
        else:
            live = [link for link in self.links if link.is_alive]
            self.asked = [link for link in live if link.offer(self.unsent, depth, self.step_timeout_s, shape, wire_budget)]
            self._dropped = [link.name for link in live if not link.is_alive]
            # A link behind (not asked, or told several steps' tokens at once) is no steady step.
            is_steady = (is_steady and len(self.asked) == len(live)
                         and not any(link.is_catching_up for link in self.asked))
        self.is_steady = is_steady
        self.unsent = []
        self.num_unsent_steps = 0
        self.is_awaiting = True
        self.asked_depth = len(widths)

    def tree(self, root: int) -> DraftTree:
        """The tree for this step (root-only when none was asked), the speculators that failed and
        those it went without (late). A step that waited for a link in vain, or went without one,
        is no steady step: its time is no speculation cost."""
        if not self.is_awaiting:
            return DraftTree(TokenTree.with_root(root), [], 0, 0.0, False)
        self.is_awaiting = False
        started = time.perf_counter()
        tree, failed, late = gather_tree(self.links, self.asked, root, self.step_timeout_s, self.vocab_size,
                                         self._max_nodes)
        failed, self._dropped = self._dropped + failed, []
        depth = self.asked_depth
        if self._is_dynamic:  # the SSM levels the speculators ran; steady: not the SSMs' first tree (the prompt)
            depth = max((link.last_levels for link in self.asked if link.is_alive), default=0)
            self.is_steady = self.is_steady and (not depth or self._has_ever_run_ssm)
            self._has_ever_run_ssm = self._has_ever_run_ssm or bool(depth)
        self.is_steady = self.is_steady and not failed and not late
        return DraftTree(tree, failed, depth, time.perf_counter() - started, True, tuple(late))

    def after_step(self, verified: list[int]) -> None:
        """Records a verified step; its tokens go out with the next request for a tree."""
        self.history.extend(verified)
        self.unsent.extend(verified)
        self.num_unsent_steps += 1

    def close(self) -> None:
        for link in self.links:
            link.close()


def co_located_pool(entries: tuple[str, ...], llm, dtype: str, device: str, execution=None, prefer: str = "float32",
                    cache_dir=None, suffix_cache_tokens: int = SUFFIX_CACHE_TOKENS) -> LocalSpeculation | None:
    """The pool this verifier hosts itself (single-host deployments: no speculator hop): SSM
    directories and model-free members, the in-process engine's `LocalSpeculation` with the same
    pool semantics; None for an empty pool (incremental decoding). The SSMs run on the LLM's
    attention backend and CUDA graphs (`execution`, an ExecConfig), never offloaded, in `dtype`
    ("auto": the fastest here, `prefer` on ties, the measurement cached under `cache_dir`)."""
    dirs, names = split_pool(entries, is_model_free=False)  # the configuration resolved the pool
    if not dirs and not names:
        return None
    ssm_exec = None if execution is None else replace(execution, offload=False)
    ssms = [load_ssm(d, dtype, device, llm.kv.num_slots, ssm_exec, prefer=prefer, cache_dir=cache_dir) for d in dirs]
    for d, ssm in zip(dirs, ssms):
        if ssm.cfg.vocab_size != llm.cfg.vocab_size:
            raise UserError(f"SSM {d}: vocabulary {ssm.cfg.vocab_size}, the LLM's is {llm.cfg.vocab_size}")
    members = model_free_members(names, dirs, suffix_cache_tokens)
    return LocalSpeculation(Speculator(ssms, members), [d.name for d in dirs])


def pool_context(source, llm) -> int:
    """The context a request may use: the LLM's, and every co-located SSM's."""
    runners = source.speculator.runners if isinstance(source, LocalSpeculation) else []
    return min([llm.max_context] + [r.max_context for r in runners])
