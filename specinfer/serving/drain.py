"""Draining on SIGTERM: finish the work in flight, hand over what cannot finish in time.

A service that stops (a rolling update, a scale-down) first reports NOT_SERVING and takes no new
request; then it lets its requests in flight finish. How long that takes is known: each request
has so many tokens left to generate, at the speed the service measures now. The drain lasts as
long as they need, with a safety margin, and never more than the service's grace setting
(`--grace-s`: the whole time its orchestrator allows between SIGTERM and a kill; compose's
`stop_grace_period` and Kubernetes' `terminationGracePeriodSeconds` are set from it). A request
that cannot finish within it is handed over at once instead of being cut at the end: a verifier
ends its stream UNAVAILABLE, and the gateway continues it on another verifier from the tokens so
far (exact, greedy or sampled: SpecInfer's verification depends on the context only, arXiv
2305.09781 Section 4); a gateway leaves it resumable, and another gateway takes it over
(ResumeStream). Whatever the prediction missed is handed over the same way shortly before the
grace ends, so nothing is cut by the kill.

Plain Python: the gateway imports this too.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Protocol

from specinfer import limits

log = logging.getLogger(__name__)


class Drainable(Protocol):
    """A service's work in flight, as a drain sees it."""

    def stop_taking(self) -> None:
        """Takes no new request from now on (one that arrives is told to go elsewhere)."""

    def in_flight(self) -> list[tuple[Hashable, int]]:
        """(key, tokens it still has to generate at most) of every request in flight."""

    def token_s(self) -> float | None:
        """Seconds per output token of one request at the present load; None while unknown."""

    def hand_over(self, keys: list[Hashable]) -> None:
        """Ends these requests now so that they go on elsewhere, exactly where they are."""


@dataclass(frozen=True)
class DrainPlan:
    finish_by_s: float  # from the drain's start: what is still running then is handed over
    grace_s: float  # the server's grace period: finish_by_s plus the time to hand over
    hand_over_now: tuple[Hashable, ...]  # requests that cannot finish within the cap


def handover_margin(cap_s: float) -> float:
    """What the end of the grace keeps for handing over and exiting."""
    return min(limits.DRAIN_HANDOVER_S, limits.DRAIN_HANDOVER_SHARE * cap_s)


def plan_drain(in_flight: list[tuple[Hashable, int]], token_s: float | None, cap_s: float) -> DrainPlan:
    """Each request's predicted time to finish (its tokens left at `token_s`, times a safety
    factor, plus slack); those that cannot finish by the cap less the handover margin are handed
    over now, and the drain lasts until the slowest of the others is predicted done."""
    margin = handover_margin(cap_s)
    latest = max(0.0, cap_s - margin)
    if not in_flight:
        return DrainPlan(0.0, 0.0, ())
    if token_s is None or token_s <= 0:  # no measurement: give them all the time there is
        return DrainPlan(latest, latest + margin, ())
    etas = {key: num_left * token_s * limits.DRAIN_SAFETY_FACTOR + limits.DRAIN_SLACK_S for key, num_left in in_flight}
    now = tuple(key for key, eta in etas.items() if eta > latest)
    finish_by = max((eta for eta in etas.values() if eta <= latest), default=0.0)
    return DrainPlan(finish_by, min(cap_s, finish_by + margin), now)


def begin_drain(work: Drainable, cap_s: float, sleep: Callable[[float], None] = time.sleep) -> float:
    """Stops taking requests, hands over at once what cannot finish within `cap_s`, and starts a
    thread that hands over what is still running when the plan says it should be done. Returns
    the grace period the server's stop should be given."""
    work.stop_taking()
    plan = plan_drain(work.in_flight(), work.token_s(), cap_s)
    log.info("draining: %d request(s) in flight, done in %.1f s (grace %.1f s of at most %.1f s), %d handed over now",
             len(work.in_flight()), plan.finish_by_s, plan.grace_s, cap_s, len(plan.hand_over_now))
    if plan.hand_over_now:
        work.hand_over(list(plan.hand_over_now))

    def hand_over_the_rest() -> None:
        sleep(plan.finish_by_s)
        left = [key for key, _ in work.in_flight()]
        if left:
            log.warning("drain: %d request(s) still running after %.1f s: handed over", len(left), plan.finish_by_s)
            work.hand_over(left)

    if plan.grace_s > 0:
        threading.Thread(target=hand_over_the_rest, name="drain-handover", daemon=True).start()
    return plan.grace_s
