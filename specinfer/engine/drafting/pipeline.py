"""Pipelined speculation: the next token tree is grown while the LLM still verifies this one.

SpecInfer's step (Section 2, Figure 2) is speculate, then verify: the SSMs wait for the LLM's
verdict before they can draft again, and the LLM waits for the drafts. Here, once a request's
tree t is handed out, its SSMs assume the outcome they themselves believe most likely (the
primary SSM's top-1 path through tree t, fully accepted, and the SSM's own top-1 token after it
as the LLM's bonus token) and grow tree t+1 from there (`build_ahead`). When the verified outcome
arrives (`settle`):

- it is the one assumed: tree t+1 is ready at once, and every SSM cache is already in place;
- it is not: tree t+1 is dropped, each SSM keeps the part of its cache the two outcomes share,
  and re-reads the rest (the ordinary catch-up), as if nothing had been drafted ahead.

Which tree the LLM verifies never changes its output (verification keeps exactly the LLM's own
tokens whatever the tree), so outputs are identical with and without pipelining. Trees are
drafted ahead for greedy requests of static widths; a dynamic tree's budget is priced after the
verdict, and a sampled request's assumed outcome would need the LLM's sample, which only the
verdict brings.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from specinfer.engine.runtime.runner import chain_work
from specinfer.engine.drafting.speculator import Proposal, SSMState, SSMTree, Speculator
from specinfer.engine.verification.sampling import first_max

log = logging.getLogger(__name__)


@dataclass
class Ahead:
    """One request's tree t+1, drafted before step t's outcome was known."""

    path: list[int]  # the accepted tokens assumed (tree t's primary top-1 path, root excluded)
    bonus: int  # the LLM's bonus token assumed (the primary SSM's top-1 after the path)
    widths: tuple[int, ...]  # the widths tree t+1 was expanded with
    base: list[int | None]  # per SSM: committed slots before the assumption (None: not used)
    ssm_trees: list[SSMTree | None]  # tree t+1 in each SSM


def predicted_path(ssm_trees: list[SSMTree | None] | None) -> list[int]:
    """The outcome the request's primary SSM (its first) believes most likely: the top-1 child
    at every node of its tree, down to a leaf. Empty when the step had no SSM tree."""
    first = next((t for t in ssm_trees or [] if t is not None), None)
    if first is None:
        return []
    tree, node, path = first.tree, 0, []
    while tree.children[node]:
        node = tree.children[node][0]  # children in the order drafted: most probable first
        path.append(tree.tokens[node])
    return path


def can_draft_ahead(p: Proposal, ssm_trees: list[SSMTree | None] | None, num_ssms: int) -> bool:
    """Whether tree t+1 may be drafted ahead: a greedy step of static widths in which every SSM
    the request uses built a tree (so no SSM has tokens queued) and the primary one proposed a
    path. (A dynamic tree's next budget is priced after the verdict.)"""
    if not p.params.is_greedy or p.is_model_free_only or p.budget is not None or not ssm_trees:
        return False
    used = [m for m in range(num_ssms) if p.states[m] is not None]
    return bool(used) and all(ssm_trees[m] is not None and not p.states[m].pending for m in used) \
        and bool(predicted_path(ssm_trees))


def build_ahead(speculator: Speculator, items: list[tuple[Proposal, list[SSMTree | None]]],
                max_context: int) -> list[Ahead | None]:
    """Drafts tree t+1 of each request (its step-t proposal and SSM trees), assuming the
    predicted outcome; None where it may not (`can_draft_ahead`) or the context has no room.
    One forward per SSM finds the assumed bonus tokens; one per level grows the trees. Should a
    pass fail (an SSM cache full), the requests' aheads are left unfinished: they never stand,
    and `settle` rolls their caches back as usual."""
    runners = speculator.runners
    out: list[Ahead | None] = [None] * len(items)
    live = []
    for i, (p, trees) in enumerate(items):
        if not can_draft_ahead(p, trees, len(runners)):
            continue
        path = predicted_path(trees)
        states: list[SSMState | None] = list(p.states[: len(runners)])
        num_tokens = next(s for s in states if s is not None).seq.num_committed + len(path) + 1
        depth = min(len(p.shape.widths), max_context - num_tokens - 1)
        if depth <= 0:
            continue
        out[i] = ahead = Ahead(path, -1, (), [s.seq.num_committed if s is not None else None for s in states],
                               [None] * len(runners))
        for m, s in enumerate(states):
            if s is not None:
                # The leaf is read again even when its SSM fed it, so its logits give the bonus.
                speculator.commit_path(m, s, trees[m], path[:-1])
                s.pending.extend(path[len(path) - 1:])
        live.append((ahead, p, depth))
    try:
        _grow_ahead(speculator, live)
    except Exception:  # noqa: BLE001 - a failed ahead only costs the catch-up it saved
        log.warning("drafting ahead failed; the requests draft after their verdicts", exc_info=True)
    return out


def _grow_ahead(speculator: Speculator, live: list[tuple[Ahead, Proposal, int]]) -> None:
    # The assumed bonus: the primary SSM's top-1 after the path (one batched chain pass per SSM).
    by_primary: dict[int, list[tuple[Ahead, SSMState]]] = {}
    for ahead, p, _ in live:
        m = _primary(p)
        by_primary.setdefault(m, []).append((ahead, p.states[m]))
    for m, entries in by_primary.items():
        logits = speculator.runners[m].run([chain_work(s.seq, s.pending, "last") for _, s in entries])
        for (ahead, s), rows in zip(entries, logits):
            s.seq.num_committed += len(s.pending)
            s.pending = []
            ahead.bonus = first_max(rows[-1:])[0]
    proposals = []
    for ahead, p, depth in live:
        for s in p.states[: len(speculator.runners)]:
            if s is not None:
                s.pending.append(ahead.bonus)
        proposals.append(replace(p, shape=p.shape.clipped(depth), max_depth=depth))
    for (ahead, _, _), proposal, trees in zip(live, proposals, speculator.expand(proposals)):
        ahead.widths, ahead.ssm_trees = proposal.shape.widths, trees


def settle(speculator: Speculator, states: list, ahead: Ahead, accepted: list[int], bonus: int,
           widths: tuple[int, ...], is_model_free_only: bool = False) -> list[SSMTree | None] | None:
    """Applies step t's verified outcome to a request that drafted ahead. Returns the SSM trees of
    tree t+1 when they stand (the outcome is the one assumed and the next step asks for the
    same widths); otherwise rolls every SSM back to what the outcomes share and returns None
    (the caller then drafts as usual). Model-free members simply read the outcome."""
    num_ssms = len(speculator.runners)
    for i, d in enumerate(speculator.model_free):
        if states[num_ssms + i] is not None:
            d.extend(states[num_ssms + i], accepted + [bonus])
    if (accepted == ahead.path and bonus == ahead.bonus and widths == ahead.widths and widths
            and not is_model_free_only):
        return ahead.ssm_trees
    verified, assumed = accepted + [bonus], ahead.path + [ahead.bonus]
    shared = 0
    while shared < min(len(verified), len(assumed)) and verified[shared] == assumed[shared]:
        shared += 1
    shared = min(shared, len(verified) - 1)  # the root is always read again: its logits start the tree
    for m, s in enumerate(states[:num_ssms]):
        if s is None:
            continue
        # What an SSM committed past `base` is always a prefix of the assumed outcome.
        kept = min(shared, s.seq.num_committed - ahead.base[m])
        s.seq.num_committed = ahead.base[m] + kept
        s.pending = verified[kept:]
    return None


def _primary(p: Proposal) -> int:
    return next(m for m, s in enumerate(p.states) if s is not None)
