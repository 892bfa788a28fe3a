"""A speculator that stalls costs a step a deadline from its own pace, not the stall.

A step waits for a speculator's tree at most a small multiple of that speculator's recent answer
latency; a late tree is skipped (the step verifies what it has: plain decoding here), the answer
it is still owed is dropped when it comes, and the speculator's trees are used again as soon as
it answers in time. Only a speculator that owes an answer for the whole step timeout is dropped.
Trees never change the LLM's output, so greedy output stays identical through all of it.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest

from services.verifier.speculators import SpeculationDriver, SpeculatorLink, SpeculatorPace
from specinfer.engine.drafting.tree import TokenTree
from specinfer.limits import SPECULATOR_DEADLINE_FLOOR_S, SPECULATOR_LATENCY_WINDOW
from specinfer.params import TreeShape
from specinfer.serving.trees import tree_to_proto
from specinfer.v1 import specinfer_pb2 as pb
from util import start_stack, wait_until

PROMPT = [9, 8, 7, 6, 5, 9, 8, 7]
NEW_TOKENS = 480  # the tiny pair's context is 512
WIDTHS = (1, 1, 3, 1, 1, 1)
LLM_PASS_S = 0.01  # each LLM pass takes this much longer, as a larger LLM's would (the tiny one's takes ~1 ms)
STALL_AT = 10  # the speculator stalls once the request streamed this many steps
STALLED_STEPS = 20  # ... and answers again once this many more were streamed without it


# ---- the deadline ----------------------------------------------------------------------------------
def test_the_deadline_follows_the_speculators_own_pace_and_ignores_a_stall():
    pace = SpeculatorPace()
    assert pace.allowance(5.0) == 5.0  # nothing known yet: the step timeout
    for _ in range(SPECULATOR_LATENCY_WINDOW):
        pace.observe(0.010)
    assert pace.allowance(5.0) == pytest.approx(2 * 0.010 + SPECULATOR_DEADLINE_FLOOR_S)
    pace.observe(5.0)  # the answer a stall delayed
    assert pace.allowance(5.0) == pytest.approx(2 * 0.010 + SPECULATOR_DEADLINE_FLOOR_S)
    for _ in range(SPECULATOR_LATENCY_WINDOW // 2):
        pace.observe(0.100)  # slower for good: the deadline follows
    assert pace.allowance(5.0) == pytest.approx(2 * 0.100 + SPECULATOR_DEADLINE_FLOOR_S)
    assert pace.allowance(0.15) == 0.15  # never past the step timeout


# ---- the lockstep stream, against a scripted speculator ---------------------------------------------
class ScriptedCall:
    """A Speculate stream whose answers the test lets out one at a time (`answer`). Each answer is
    a two-node tree rooted at the message's last token, numbered like the speculator's."""

    def __init__(self, requests):
        self.requests, self.received = requests, []
        self._gate: queue.Queue = queue.Queue()
        self._is_cancelled = False

    def answer(self, num: int = 1) -> None:
        for _ in range(num):
            self._gate.put(True)

    def cancel(self) -> None:
        self._is_cancelled = True
        self._gate.put(False)

    def __iter__(self):
        for step, request in enumerate(self.requests):
            self.received.append(request)
            kind = request.WhichOneof("kind")
            if kind == "feedback" and request.feedback.done:
                return
            if not self._gate.get() or self._is_cancelled:
                return
            root = request.start.context_ids[-1] if kind == "start" else request.feedback.bonus
            tree = TokenTree.with_root(root)
            tree.add_draft(0, 1)
            yield pb.SpeculateResponse(tree=tree_to_proto(tree), step=step)


class ScriptedStub:
    def __init__(self):
        self.call: ScriptedCall | None = None

    def Speculate(self, requests, timeout=None, metadata=None):
        self.call = ScriptedCall(requests)
        return self.call


class WatchedInbox(queue.Queue):
    """A link's inbox of answers that records how long each read of it may wait (0: not at all)."""

    def __init__(self):
        super().__init__()
        self.waits: list[float] = []

    def get(self, block=True, timeout=None):
        self.waits.append(0.0 if not block else float("inf") if timeout is None else timeout)
        return super().get(block, timeout)


def scripted_driver(step_timeout_s: float) -> tuple[SpeculationDriver, ScriptedStub]:
    stub = ScriptedStub()

    def open_links(start):
        link = SpeculatorLink("s", stub, 30.0)
        link._inbox = WatchedInbox()
        link.open(start, [])
        return [link]

    return SpeculationDriver(open_links, [5, 6, 7], TreeShape((2, 1)), 100, step_timeout_s), stub


def tree_and_wait(driver: SpeculationDriver, root: int):
    """The step's tree, and the longest its link's answer was waited for (0: not at all)."""
    inbox = driver.links[0]._inbox
    num_before = len(inbox.waits)
    draft = driver.tree(root)
    return draft, max(inbox.waits[num_before:], default=0.0)


def test_a_late_tree_is_skipped_its_stale_answer_dropped_and_the_next_one_used():
    driver, stub = scripted_driver(step_timeout_s=5.0)
    driver.ask((2, 1))
    stub.call.answer()
    draft, _ = tree_and_wait(driver, 7)  # the first answer: the whole step timeout was allowed
    assert len(draft.tree) == 2 and not draft.late
    for token in range(10, 20):  # a few answers in time: the link learns its pace
        driver.after_step([token])
        driver.ask((2, 1))
        stub.call.answer()
        draft, _ = tree_and_wait(driver, token)
        assert len(draft.tree) == 2 and not draft.late
    assert driver.is_steady
    (link,) = driver.links
    allowance = link.pace.allowance(5.0)
    assert allowance < 5.0  # learnt from its answers: less than the step timeout

    driver.after_step([30, 31])
    driver.ask((2, 1))  # the speculator stalls on this one
    draft, waited = tree_and_wait(driver, 31)
    assert draft.tree.tokens == [31] and draft.late == ("s",) and not draft.failed  # plain decoding
    assert waited <= allowance and not driver.is_steady  # its pace's allowance, not the step timeout
    num_received = 12  # the start, 10 feedbacks answered and the one it stalls on
    assert wait_until(lambda: len(stub.call.received) == num_received)

    driver.after_step([32])
    driver.ask((2, 1))  # still owed: not asked, the tokens wait for its next message
    time.sleep(0.05)
    assert len(stub.call.received) == num_received
    draft, waited = tree_and_wait(driver, 32)
    assert draft.late == ("s",) and waited == 0 and link.is_alive  # not waited for at all

    stub.call.answer()  # the stalled answer comes, late: it is dropped (its root, 31, is stale)
    assert link.is_owing
    assert wait_until(lambda: link._inbox.qsize() > 0)  # it arrives
    driver.after_step([33])
    driver.ask((2, 1))
    assert wait_until(lambda: len(stub.call.received) == num_received + 1)  # the speculator reads it
    told = stub.call.received[-1].feedback
    assert list(told.accepted) + [told.bonus] == [32, 33]  # both steps since its last message, at once
    assert not driver.is_steady  # it catches up on two steps
    stub.call.answer()
    draft, _ = tree_and_wait(driver, 33)
    assert draft.tree.tokens[0] == 33 and len(draft.tree) == 2 and not draft.late and not draft.failed
    driver.after_step([34])
    driver.ask((2, 1))
    assert driver.is_steady  # in step again
    stub.call.answer()
    assert len(driver.tree(34).tree) == 2
    assert link.is_alive and not link.is_late
    driver.close()


def test_a_link_that_owes_an_answer_for_the_step_timeout_is_dropped():
    driver, stub = scripted_driver(step_timeout_s=0.3)
    driver.ask((2, 1))
    stub.call.answer()
    driver.tree(7)
    for token in (8, 9, 10):
        driver.after_step([token])
        driver.ask((2, 1))
        stub.call.answer()
        driver.tree(token)
    driver.after_step([11])
    driver.ask((2, 1))  # never answered
    draft = driver.tree(11)
    assert draft.late == ("s",) and not draft.failed
    time.sleep(0.3)
    driver.after_step([12])
    driver.ask((2, 1))
    draft = driver.tree(12)
    assert draft.failed == ["s"] and not draft.late and not driver.is_usable


# ---- a real speculator that stalls mid-stream --------------------------------------------------------
@pytest.fixture(scope="module")
def stack(tiny_pair):
    with start_stack(tiny_pair.llm, [tiny_pair.ssms[0]], tree_width=WIDTHS, is_load_aware=False,
                     speculator_step_timeout_s=5) as running:
        runner = running.verifier_servicer.engine.verifier.runner
        run = runner.run

        def slower(*args, **kwargs):
            time.sleep(LLM_PASS_S)
            return run(*args, **kwargs)

        runner.run = slower
        yield running


class Stall:
    """Holds the speculator's tree building (its worker's steps) from `start()` until `end()`."""

    def __init__(self, monkeypatch, worker):
        self.is_stalled, self.resumed = threading.Event(), threading.Event()
        self.num_held = 0
        step = worker.step

        def held(*args, **kwargs):
            if self.is_stalled.is_set():
                self.num_held += 1
                self.resumed.wait(60)  # until the test ends the stall (a minute guards a hang)
            return step(*args, **kwargs)

        monkeypatch.setattr(worker, "step", held)

    @property
    def phase(self) -> str:
        return "after" if self.resumed.is_set() else "during" if self.is_stalled.is_set() else "before"

    def start(self) -> None:
        self.is_stalled.set()

    def end(self) -> None:
        self.is_stalled.clear()
        self.resumed.set()


def stream(stack, max_new_tokens: int = NEW_TOKENS, stall: Stall | None = None, on_step=None):
    """A greedy request; (token ids, [(the stall's phase when it came, tokens) per step], final stats).
    `on_step(steps)` is called after each step came."""
    request = pb.VerifierGenerateRequest(prompt_ids=PROMPT, max_new_tokens=max_new_tokens, speculate=True,
                                         ignore_eos=True)
    tokens, steps, stats = [], [], None
    for r in stack.verifier_stub.Generate(request, timeout=120):
        tokens += list(r.token_ids)
        steps.append((stall.phase if stall is not None else "", len(r.token_ids)))
        if on_step is not None:
            on_step(steps)
        if r.HasField("stats"):
            stats = r.stats
    return tokens, steps, stats


def late_trees(stack) -> float:
    """Steps so far that went on without a speculator's tree (the verifier's counter)."""
    counter = stack.verifier_servicer.metrics.late_trees
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


@pytest.fixture(scope="module")
def unstalled(stack):
    tokens, steps, stats = stream(stack)
    assert stats.tokens_per_step > 1.5 and not stats.fell_back  # the speculator's trees pay here
    return tokens, steps


def test_a_stalled_speculator_costs_its_deadline_and_is_used_again(stack, unstalled, monkeypatch):
    """The stall ends only once STALLED_STEPS steps came while the speculator was held: a request
    that waited out the stall would never see it end (and hang, which its deadline catches)."""
    stall = Stall(monkeypatch, stack.speculators[0][1].worker)

    def on_step(steps):
        if len(steps) == STALL_AT:
            stall.start()
        elif stall.phase == "during" and sum(phase == "during" for phase, _ in steps) >= STALLED_STEPS:
            stall.end()

    tokens, steps, stats = stream(stack, stall=stall, on_step=on_step)
    assert tokens == unstalled[0]  # (a) the LLM's output, as without the stall
    assert stall.num_held >= 1  # the speculator really stalled ...
    during = [n for phase, n in steps if phase == "during"]
    # ... (b) and the request went on without it, decoding plainly (but for a tree built before the
    # stall began): no step waited out the stall
    assert len(during) == STALLED_STEPS and sum(n > 1 for n in during) <= 2
    after = [n for phase, n in steps if phase == "after"][5:]  # past the steps that catch up
    assert len(after) >= 20 and sum(after) / len(after) > 1.5  # (c) its trees are accepted again
    assert not stats.fell_back  # late is not failed: the link was never dropped


def test_a_speculator_silent_for_the_step_timeout_is_dropped_and_the_output_kept(stack, unstalled, monkeypatch):
    monkeypatch.setattr(stack.verifier_servicer.engine.source, "step_timeout_s", 1.0)
    stall = Stall(monkeypatch, stack.speculators[0][1].worker)
    num_late = late_trees(stack)
    try:
        tokens, steps, stats = stream(stack, 200, on_step=lambda steps: len(steps) == STALL_AT and stall.start())
    finally:
        stall.end()
    assert tokens == unstalled[0][:200]
    assert stats.fell_back  # dropped as a dead speculator would be
    # ... after steps went on without its tree while it owed one: none waited out the step timeout
    assert late_trees(stack) - num_late >= 2
