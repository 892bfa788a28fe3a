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

import grpc

from specinfer.serving.convert import tree_from_proto
from specinfer.serving.grpc_server import CHANNEL_OPTIONS
from specinfer.tree import TokenTree, merge_trees
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

    def __init__(self, name: str, stub: pb_grpc.SpeculatorStub, start: pb.SpeculateStart, timeout_s: float,
                 metadata: list[tuple[str, str]]):
        self.name = name
        self.is_alive = True
        self._outbox: queue.Queue = queue.Queue()
        self._inbox: queue.Queue = queue.Queue()
        self._outbox.put(pb.SpeculateRequest(start=start))
        self._call = stub.Speculate(iter(self._outbox.get, _CLOSED), timeout=timeout_s, metadata=metadata)
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"spec-link-{name}")
        self._reader.start()

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

    def send_feedback(self, accepted: list[int], bonus: int, max_depth: int) -> None:
        self._outbox.put(pb.SpeculateRequest(feedback=pb.SpeculateFeedback(
            accepted=accepted, bonus=bonus, max_depth=max_depth)))

    def fail(self, reason: str) -> None:
        if self.is_alive:
            log.warning("dropping speculator %s for this request: %s", self.name, reason)
        self.is_alive = False
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
