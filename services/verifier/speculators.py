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
from dataclasses import replace

import grpc

from specinfer.serving.convert import shape_to_proto
from specinfer.serving.trees import tree_from_proto
from specinfer.serving.grpc_server import CHANNEL_OPTIONS
from specinfer.params import TreeShape
from specinfer.engine.tree import TokenTree, merge_trees
from specinfer.v1 import specinfer_pb2 as pb
from specinfer.v1 import specinfer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
_CLOSED = object()


def speculator_stub(target: str) -> pb_grpc.SpeculatorStub:
    options = list(CHANNEL_OPTIONS)
    if target.startswith("dns:"):  # several replicas behind one DNS name: spread requests
        options.append(("grpc.lb_policy_name", "round_robin"))
    return pb_grpc.SpeculatorStub(grpc.insecure_channel(target, options=options))


class SpeculatorLink:
    """One request's stream to one speculator."""

    def __init__(self, name: str, stub: pb_grpc.SpeculatorStub, timeout_s: float):
        self.name = name
        self.is_alive = True
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

    def send_feedback(self, accepted: list[int], bonus: int, max_depth: int, shape: pb.TreeShape | None = None) -> None:
        feedback = pb.SpeculateFeedback(accepted=accepted, bonus=bonus, max_depth=max_depth)
        if shape is not None:
            feedback.shape.CopyFrom(shape)
        self._outbox.put(pb.SpeculateRequest(feedback=feedback))

    def fail(self, reason: str) -> None:
        if self.is_alive:
            log.warning("dropping speculator %s for this request: %s", self.name, reason)
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


class SpeculationDriver:
    """One request's speculation across steps: which tree to ask for, and when.

    The shape of each step comes from `choose_widths(batch_size)` (load-aware) or is fixed.
    Streams to the speculators open only when the first tree is wanted, so a request that never
    speculates costs the speculators nothing. A step that should not speculate asks nothing; the
    tokens it verifies reach the speculators with the next request for a tree (their caches
    catch up then), so switching speculation off and on costs no extra round trip.
    """

    def __init__(self, open_links, context_ids: list[int], shape: TreeShape, choose_widths, vocab_size: int,
                 is_greedy: bool, step_timeout_s: float):
        self.open_links = open_links  # (start message) -> links; None when there are no speculators
        self.links: list[SpeculatorLink] = []
        self.history = list(context_ids)  # every verified token so far, prompt included
        self.shape = shape
        self.choose_widths = choose_widths  # batch size -> widths; () = do not speculate
        self.vocab_size = vocab_size
        self.is_greedy = is_greedy
        self.step_timeout_s = step_timeout_s
        self.unsent: list[int] = []  # verified tokens the open streams have not been told about
        self.is_awaiting = False
        self.asked_depth = 0
        self.num_unsent_steps = 0  # verified steps whose tokens the streams have not been told about
        # Whether the tree asked last costs what a steady step costs: not the first (which opens the
        # streams and prefills the SSMs on the whole context) nor one after plain steps (catch-up).
        self.is_steady = False

    @property
    def is_usable(self) -> bool:
        if self.open_links is None:
            return False
        return not self.links or any(link.is_alive for link in self.links)

    def plan(self, budget_depth: int, batch_size: int) -> tuple[int, ...]:
        """Widths for the next tree, clipped to the depth the request has left."""
        if not self.is_usable or budget_depth <= 0:
            return ()
        return tuple(self.choose_widths(batch_size))[:budget_depth]

    def ask(self, widths: tuple[int, ...]) -> None:
        """Requests the next tree (opening the streams with the whole context the first time)."""
        if not widths or not self.is_usable:
            return
        shape = self._shape_proto(widths)
        self.is_steady = bool(self.links) and self.num_unsent_steps == 1
        if not self.links:
            start = pb.SpeculateStart(context_ids=self.history, shape=shape, max_depth=len(widths))
            self.links = self.open_links(start)
        else:
            for link in self.links:
                if link.is_alive:
                    link.send_feedback(self.unsent[:-1], self.unsent[-1], len(widths), shape)
        self.unsent = []
        self.num_unsent_steps = 0
        self.is_awaiting = True
        self.asked_depth = len(widths)

    def tree(self, root: int) -> tuple[TokenTree, list[str], int]:
        """The tree for this step (root-only when none was asked), failures, and its depth."""
        if not self.is_awaiting:
            return TokenTree.with_root(root), [], 0
        self.is_awaiting = False
        tree, failed = gather_tree(self.links, root, self.step_timeout_s, self.vocab_size, self.is_greedy,
                                   self.shape.max_nodes)
        return tree, failed, self.asked_depth

    def after_step(self, verified: list[int], widths: tuple[int, ...]) -> None:
        """Records a verified step, then asks for the next tree if `widths` says to speculate."""
        self.history.extend(verified)
        self.unsent.extend(verified)
        self.num_unsent_steps += 1
        self.ask(widths)

    def close(self) -> None:
        for link in self.links:
            link.close()

    def _shape_proto(self, widths: tuple[int, ...]) -> pb.TreeShape:
        return shape_to_proto(replace(self.shape, widths=widths))
