"""The drafter: every request's drafting state in one pool host, and its trees built in batches.

SpecInfer builds the token trees of all requests in a batch together (Section 5): one SSM
forward per tree level covers every request that asked for a tree. A `Drafter` holds each
request's `DraftSession` (its SSM caches, its model-free members' contexts), applies the
verified outcome of its steps (Section 4: the SSMs commit what they computed on the accepted
path), and builds the next trees asked of it in one batch. Where the SSMs do not share the
LLM's compute, it may draft a greedy request's next tree while the LLM still verifies the last
one (`pipeline`).

It is the one drafting type of every pool host: the in-process engine and a co-located verifier
(`llm_engine.LocalSpeculation`), and the speculator service (`workers.SpeculatorWorker`). Not
thread-safe: each host calls it from the one thread that runs its SSMs (or under a lock).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from specinfer.engine.drafting.pipeline import build_ahead, settle
from specinfer.engine.drafting.speculator import Built, DraftSession, Proposal, SSMTree, Speculator
from specinfer.engine.drafting.tree import TokenTree
from specinfer.params import SamplingParams, TreeShape

# One verified step of a request: the tree it verified (None: a plain step), the accepted
# tokens and the LLM's bonus token.
Outcome = tuple[Built | None, list[int], int]


@dataclass
class Ask:
    """One request's ask for its next tree: the outcomes verified since its last tree (oldest
    first), and the tree wanted (None: the root alone, no SSM pass)."""

    session: DraftSession
    proposal: Proposal | None
    outcomes: list[Outcome] = field(default_factory=list)


class Drafter:
    """Builds every asked request's tree of a step together and keeps its pool states current."""

    def __init__(self, speculator: Speculator, is_pipelined: bool = False,
                 on_ahead: Callable[[str], None] | None = None):
        self.speculator = speculator
        # Pipelined: a greedy request's next tree is drafted from the outcome its SSMs believe
        # while the LLM verifies (`draft_ahead`, which the host calls when it has nothing else to do).
        self.is_pipelined = is_pipelined and bool(speculator.runners)
        self.max_context = min((r.max_context for r in speculator.runners), default=0)
        self.num_ahead = {"stood": 0, "dropped": 0}
        self._on_ahead = on_ahead  # told "stood" or "dropped" for each tree drafted ahead
        self._wanted: dict[int, DraftSession] = {}  # sessions whose next tree may be drafted ahead
        self.num_open = 0
        self._count_lock = threading.Lock()

    def open(self, context_ids: list[int], params: SamplingParams, shape: TreeShape,
             ssm_indices: list[int] | None = None) -> DraftSession:
        session = self.speculator.open(context_ids, params, shape, ssm_indices)
        with self._count_lock:
            self.num_open += 1
        return session

    def close(self, session: DraftSession, unread: list[Outcome] = ()) -> None:
        """Frees the request's pool states; the outcomes it never read still calibrate the
        dynamic trees' drafters."""
        self._wanted.pop(id(session), None)
        for built, accepted, bonus in unread:
            self.speculator.learn(built, accepted, bonus)
        self.speculator.release(session.states)
        with self._count_lock:
            self.num_open -= 1

    @property
    def has_wanted(self) -> bool:
        """Whether some request's next tree may be drafted ahead."""
        return bool(self._wanted)

    def build(self, asks: list[Ask]) -> list[tuple[Built | None, float]]:
        """Each ask's tree (None where it asked for the root alone) and the seconds since the
        batch began when it was ready. Outcomes are read first; a tree drafted ahead that stands
        is handed out at once; the others are built together."""
        started = time.perf_counter()
        out: list[tuple[Built | None, float] | None] = [None] * len(asks)
        proposing: list[int] = []
        served: list[DraftSession] = []
        for i, ask in enumerate(asks):
            session, proposal = ask.session, ask.proposal
            self._wanted.pop(id(session), None)
            ready = self._read_outcomes(session, ask.outcomes, proposal)
            session.last_proposal, session.is_last_ahead = proposal, ready is not None
            if ready is not None:
                session.last = Built(self.speculator.merge(proposal, ready), ready, None, len(proposal.shape.widths))
                session.last_batch_size = 0
                served.append(session)
                out[i] = (session.last, time.perf_counter() - started)
            elif proposal is not None:
                proposing.append(i)
            else:
                session.last = None
                out[i] = (None, time.perf_counter() - started)
        if proposing:
            built = self.speculator.propose([asks[i].proposal for i in proposing])
            seconds = time.perf_counter() - started
            for i, one in zip(proposing, built):
                session = asks[i].session
                session.last, session.last_batch_size = one, len(proposing)
                served.append(session)
                out[i] = (one, seconds)
        if self.is_pipelined:
            for session in served:
                if session.params.is_greedy:
                    self._wanted[id(session)] = session
        return out

    def root_tree(self, session: DraftSession) -> TokenTree:
        """The request's next tree when it asked for none: its last verified token alone."""
        return TokenTree.with_root(self.speculator.root(session.states))

    def draft_ahead(self) -> None:
        """Drafts the next tree of every request served since (`pipeline.build_ahead`)."""
        sessions, self._wanted = list(self._wanted.values()), {}
        items = [(s.last_proposal, s.last.ssm_trees if s.last is not None else None) for s in sessions]
        for session, ahead in zip(sessions, build_ahead(self.speculator, items, self.max_context)):
            session.ahead = ahead

    def _read_outcomes(self, session: DraftSession, outcomes: list[Outcome], proposal: Proposal | None
                       ) -> list[SSMTree | None] | None:
        """Applies the request's verified outcomes to its pool states; the SSM trees of its tree
        drafted ahead where that tree stands (its outcome is the one assumed)."""
        if session.ahead is None or not outcomes:
            for built, accepted, bonus in outcomes:
                self.speculator.feedback(session.states, built, accepted, bonus)
            return None
        ahead, session.ahead = session.ahead, None
        (_, accepted, bonus), rest = outcomes[0], outcomes[1:]
        widths = proposal.shape.widths if proposal is not None and not rest else ()
        is_model_free_only = proposal is None or proposal.is_model_free_only or not proposal.max_depth
        trees = settle(self.speculator, session.states, ahead, accepted, bonus, widths, is_model_free_only)
        for built, accepted, bonus in rest:
            self.speculator.feedback(session.states, built, accepted, bonus)
        outcome = "stood" if trees is not None else "dropped"
        self.num_ahead[outcome] += 1
        if self._on_ahead is not None:
            self._on_ahead(outcome)
        return trees
