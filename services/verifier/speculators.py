"""The verifier's side of the per-request bidirectional streams to speculator services.

Each request opens one stream per speculator: a `start`, then one feedback (accepted tokens plus
the bonus token) per verified step; each message is answered with the next token tree. A
speculator that fails or stalls is dropped for the rest of the request, and the request goes on
with the others, or with incremental decoding (root-only trees) when none is left.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import replace
from functools import partial
from typing import Callable

import grpc

from specinfer.engine.llm_engine import LocalSpeculation
from specinfer.engine.loop import DraftTree
from specinfer.engine.speculator import Speculator, model_free_member
from specinfer.engine.tree import TokenTree, merge_trees
from specinfer.errors import UserError
from specinfer.params import GenerationParams, TreeShape
from specinfer.serving.convert import sampling_to_proto, shape_to_proto
from specinfer.limits import DEFAULT_MAX_MESSAGE_BYTES, MODEL_FREE_NAMES, SPECULATOR_INFO_RETRY_S
from specinfer.serving.security import ChannelSecurity, open_channel
from specinfer.serving.settings import message_options, reconnect_options
from specinfer.serving.tracing import outgoing_metadata
from specinfer.serving.trees import tree_from_proto
from specinfer.v1 import specinfer_pb2 as pb
from specinfer.v1 import specinfer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
_CLOSED = object()


def speculator_stub(target: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                    security: ChannelSecurity | None = None) -> pb_grpc.SpeculatorStub:
    """A stub on its own channel: TLS and the internal token as `security` says."""
    options: list[tuple[str, object]] = message_options(max_message_bytes) + reconnect_options()
    if target.startswith("dns:"):  # several replicas behind one DNS name: spread requests
        options.append(("grpc.lb_policy_name", "round_robin"))
    return pb_grpc.SpeculatorStub(open_channel(target, security, options))


class SpeculatorLink:
    """One request's stream to one speculator."""

    def __init__(self, name: str, stub: pb_grpc.SpeculatorStub, timeout_s: float,
                 on_fail: Callable[[], None] | None = None):
        self.name = name
        self.is_alive = True
        self._on_fail = on_fail  # told once, when the link is dropped
        self._stub = stub
        self._timeout_s = timeout_s
        self._outbox: queue.Queue = queue.Queue()
        self._inbox: queue.Queue = queue.Queue()
        self._call = None

    def open(self, start: pb.SpeculateStart, metadata: list[tuple[str, str]]) -> None:
        """Starts the stream with its first message; the answer is the first tree."""
        self._outbox.put(pb.SpeculateRequest(start=start))
        self._call = self._stub.Speculate(iter(self._outbox.get, _CLOSED), timeout=self._timeout_s, metadata=metadata)
        threading.Thread(target=self._read, daemon=True, name=f"spec-link-{self.name}").start()

    def _read(self) -> None:
        try:
            for response in self._call:
                self._inbox.put(response)
        except grpc.RpcError as exc:
            self._inbox.put(exc)
        finally:
            self._inbox.put(_CLOSED)

    def next_tree(self, timeout_s: float, vocab_size: int, is_greedy: bool) -> TokenTree:
        """The answer to the last message; raises (and marks the link dead) on any failure."""
        try:
            item = self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            self.fail("timed out waiting for a tree")
            raise TimeoutError(f"speculator {self.name} timed out")
        if isinstance(item, pb.SpeculateResponse):
            try:
                return tree_from_proto(item.tree, vocab_size, is_greedy)
            except ValueError as exc:
                self.fail(f"sent an invalid tree: {exc}")
                raise
        self.fail(f"stream ended: {item if item is not _CLOSED else 'closed'}")
        raise ConnectionError(f"speculator {self.name} stream ended")

    def send_feedback(self, accepted: list[int], bonus: int, max_depth: int, shape: pb.TreeShape | None = None,
                      is_model_free_only: bool = False) -> None:
        feedback = pb.SpeculateFeedback(accepted=accepted, bonus=bonus, max_depth=max_depth,
                                        model_free_only=is_model_free_only)
        if shape is not None:
            feedback.shape.CopyFrom(shape)
        self._outbox.put(pb.SpeculateRequest(feedback=feedback))

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


def gather_tree(links: list[SpeculatorLink], root: int, timeout_s: float, vocab_size: int,
                is_greedy: bool, max_nodes: int) -> tuple[TokenTree, list[str]]:
    """Merges the trees of all live links; returns it and the names of links that failed now.

    A tree over `max_nodes` breaks the contract (the verifier reserved KV for that many per
    speculator), so its speculator is dropped."""
    trees, failed = [], []
    for link in links:
        if not link.is_alive:
            continue
        try:
            tree = link.next_tree(timeout_s, vocab_size, is_greedy)
        except (TimeoutError, ConnectionError, ValueError):
            failed.append(link.name)
            continue
        if tree.tokens[0] != root or len(tree) > max_nodes:
            link.fail("tree root is not the last verified token" if tree.tokens[0] != root else "tree too large")
            failed.append(link.name)
            continue
        trees.append(tree)
    if not trees:
        return TokenTree.with_root(root), failed
    return (trees[0] if len(trees) == 1 else merge_trees(trees)[0]), failed


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

    def max_draft_nodes(self, ssm_names: tuple[str, ...], shape: TreeShape) -> int:
        """Nodes beyond the root a step's merged tree may hold: each speculator's tree (model-free
        drafts included) has at most `shape.max_nodes` nodes, root included."""
        return self.num_sources(ssm_names) * (shape.max_nodes - 1)

    def hosts_model_free(self, speculators: list[tuple[str, object]], ssm_names: tuple[str, ...]) -> bool:
        """Whether one of `speculators` hosts a model-free member of the pool `ssm_names` names."""
        return any(name in MODEL_FREE_NAMES and (not ssm_names or name in ssm_names)
                   for target, stub in speculators for name in self.hosted_names(target, stub) or ())

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

        return SpeculationDriver(open_links, prompt_ids, shape, self.vocab_size, params.sampling.is_greedy,
                                 self.step_timeout_s, self.hosts_model_free(speculators, params.ssm_names))


class SpeculationDriver:
    """One request's trees from the speculator services, across steps (the engine's `Drafts`).

    Streams to the speculators open only when the first tree is wanted, so a request that never
    speculates costs the speculators nothing. A step that should not speculate asks nothing; the
    tokens it verifies reach the speculators with the next request for a tree (their caches
    catch up then), so switching speculation off and on costs no extra round trip. A step may ask
    for the pool's model-free drafts alone (no widths, a depth) when a speculator hosts one: every
    stream is asked, and one that hosts none answers with a root-only tree.
    """

    def __init__(self, open_links, context_ids: list[int], shape: TreeShape, vocab_size: int, is_greedy: bool,
                 step_timeout_s: float, has_model_free: bool = False):
        self.open_links = open_links  # (start message) -> links
        self.links: list[SpeculatorLink] = []
        self.history = list(context_ids)  # every verified token so far, prompt included
        self.shape = shape
        self.vocab_size = vocab_size
        self.is_greedy = is_greedy
        self.step_timeout_s = step_timeout_s
        self.has_model_free = has_model_free  # a chosen speculator hosts a model-free member of the pool
        self.unsent: list[int] = []  # verified tokens the open streams have not been told about
        self.is_awaiting = False
        self.asked_depth = 0
        self.num_unsent_steps = 0  # verified steps whose tokens the streams have not been told about
        # Whether the tree asked last costs what a steady step costs: an SSM tree right after one
        # (not the first, which prefills the SSMs on the whole context, nor one after plain or
        # model-free-only steps, whose tokens the SSMs catch up on first).
        self.is_steady = False
        self._is_ssm_current = False  # the SSMs built the tree asked last

    @property
    def is_usable(self) -> bool:
        return not self.links or any(link.is_alive for link in self.links)

    def ask(self, widths: tuple[int, ...], max_depth: int | None = None) -> None:
        """Requests the next tree (opening the streams with the whole context the first time).
        `max_depth` (at least the widths' depth) bounds the speculators' model-free drafts; no
        widths but a depth asks for the model-free drafts alone."""
        is_model_free_only = not widths and bool(max_depth) and self.has_model_free
        if not (widths or is_model_free_only) or not self.is_usable:
            return
        depth = max(len(widths), max_depth or 0)
        # A model-free-only ask keeps the request's shape: its node bound bounds the drafts.
        shape = shape_to_proto(replace(self.shape, widths=widths) if widths else self.shape)
        self.is_steady = bool(widths) and self._is_ssm_current and self.num_unsent_steps == 1
        self._is_ssm_current = bool(widths)
        if not self.links:
            start = pb.SpeculateStart(context_ids=self.history, shape=shape, max_depth=depth,
                                      model_free_only=is_model_free_only)
            self.links = self.open_links(start)
        else:
            for link in self.links:
                if link.is_alive:
                    link.send_feedback(self.unsent[:-1], self.unsent[-1], depth, shape, is_model_free_only)
        self.unsent = []
        self.num_unsent_steps = 0
        self.is_awaiting = True
        self.asked_depth = len(widths)  # SSM levels: 0 for model-free drafts, which cost no SSM pass

    def tree(self, root: int) -> DraftTree:
        """The tree for this step (root-only when none was asked) and the speculators that failed."""
        if not self.is_awaiting:
            return DraftTree(TokenTree.with_root(root), [], 0, 0.0)
        self.is_awaiting = False
        started = time.perf_counter()
        tree, failed = gather_tree(self.links, root, self.step_timeout_s, self.vocab_size, self.is_greedy,
                                   self.shape.max_nodes)
        return DraftTree(tree, failed, self.asked_depth, time.perf_counter() - started)

    def after_step(self, verified: list[int]) -> None:
        """Records a verified step; its tokens go out with the next request for a tree."""
        self.history.extend(verified)
        self.unsent.extend(verified)
        self.num_unsent_steps += 1

    def close(self) -> None:
        for link in self.links:
            link.close()


def co_located_pool(entries: tuple[str, ...], llm, dtype: str, device: str, execution=None, prefer: str = "float32",
                    cache_dir=None) -> LocalSpeculation | None:
    """The pool this verifier hosts itself (single-host deployments: no speculator hop): SSM
    directories and model-free members, the in-process engine's `LocalSpeculation` with the same
    pool semantics; None for an empty pool (incremental decoding). The SSMs run on the LLM's
    attention backend and CUDA graphs (`execution`, an ExecConfig), never offloaded, in `dtype`
    ("auto": the fastest here, `prefer` on ties, the measurement cached under `cache_dir`)."""
    from dataclasses import replace

    from specinfer.engine.dtype_choice import load_ssm
    from specinfer.engine.load import split_pool

    dirs, names = split_pool(entries)
    if not dirs and not names:
        return None
    ssm_exec = None if execution is None else replace(execution, offload=False)
    ssms = [load_ssm(d, dtype, device, llm.kv.num_slots, ssm_exec, prefer=prefer, cache_dir=cache_dir) for d in dirs]
    for d, ssm in zip(dirs, ssms):
        if ssm.cfg.vocab_size != llm.cfg.vocab_size:
            raise UserError(f"SSM {d}: vocabulary {ssm.cfg.vocab_size}, the LLM's is {llm.cfg.vocab_size}")
    return LocalSpeculation(Speculator(ssms, [model_free_member(n) for n in names]), [d.name for d in dirs])


def pool_context(source, llm) -> int:
    """The context a request may use: the LLM's, and every co-located SSM's."""
    runners = source.speculator.runners if isinstance(source, LocalSpeculation) else []
    return min([llm.max_context] + [r.max_context for r in runners])
