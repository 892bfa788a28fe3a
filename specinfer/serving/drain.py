"""Draining on SIGTERM: finish the work in flight, hand over what cannot finish in time.

A service that stops (a rolling update, a scale-down) first reports NOT_SERVING and takes no new
request (it still answers, refusing one UNAVAILABLE, so that a client goes elsewhere at once);
then it lets its requests in flight finish, and exits as soon as they have. Its grace
setting (`--grace-s`) is the whole time its orchestrator allows between SIGTERM and a kill
(compose's `stop_grace_period` and Kubernetes' `terminationGracePeriodSeconds` are set from it).
How long the requests need is known: each has so many tokens left, at the speed the service
measures now. One predicted to need far more than the grace is handed over at once rather than
cut at the end; the others run, and whatever is still running shortly before the grace ends (the
handover margin) is handed over then, so nothing is cut by the kill. Handing over keeps the
request exact: a verifier ends its stream UNAVAILABLE, and the gateway continues it on another
verifier from the tokens so far (SpecInfer's verification depends on the context only, greedy or
sampled with the request's seed: arXiv 2305.09781 Section 4); a gateway leaves it resumable, and
another gateway takes it over (ResumeStream).

Plain Python: the gateway imports this too.
"""

from __future__ import annotations

import logging
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
    finish_by_s: float  # from the drain's start: when the requests are predicted done (within the grace)
    hand_over_by_s: float  # what is still running then is handed over: the grace less the handover margin
    hand_over_now: tuple[Hashable, ...]  # requests predicted to need far more than the grace


def handover_margin(cap_s: float) -> float:
    """What the end of the grace keeps for handing over and exiting."""
    return min(limits.DRAIN_HANDOVER_S, limits.DRAIN_HANDOVER_SHARE * cap_s)


def plan_drain(in_flight: list[tuple[Hashable, int]], token_s: float | None, cap_s: float) -> DrainPlan:
    """Each request's predicted time to finish (its tokens left at `token_s`): one that needs more
    than DRAIN_HOPELESS_FACTOR times the time there is goes at once; the others are predicted done
    by the slowest one's time (times a safety factor, plus slack), within the time there is."""
    latest = max(0.0, cap_s - handover_margin(cap_s))
    if not in_flight or token_s is None or token_s <= 0:  # nothing to wait for, or no measurement yet
        return DrainPlan(latest if in_flight else 0.0, latest, ())
    needs = {key: num_left * token_s for key, num_left in in_flight}
    now = tuple(key for key, need in needs.items() if need > limits.DRAIN_HOPELESS_FACTOR * latest)
    rest = [need * limits.DRAIN_SAFETY_FACTOR + limits.DRAIN_SLACK_S for key, need in needs.items() if key not in now]
    return DrainPlan(min(latest, max(rest, default=0.0)), latest, now)


def drain(work: Drainable, cap_s: float, clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep) -> DrainPlan:
    """Stops taking requests, hands over at once what cannot finish within `cap_s`, waits until
    the others are done, and hands over what is still running at the plan's `hand_over_by_s`.
    The server keeps answering meanwhile (a new request is refused by `work` itself, UNAVAILABLE;
    health says NOT_SERVING); its stop afterwards needs only the handover margin."""
    work.stop_taking()
    in_flight = work.in_flight()
    plan = plan_drain(in_flight, work.token_s(), cap_s)
    log.info("draining: %d request(s) in flight, predicted done in %.1f s; the rest handed over at %.1f s "
             "(grace %.1f s); %d handed over now", len(in_flight), plan.finish_by_s, plan.hand_over_by_s, cap_s,
             len(plan.hand_over_now))
    if plan.hand_over_now:
        work.hand_over(list(plan.hand_over_now))
    deadline = clock() + plan.hand_over_by_s
    while work.in_flight() and clock() < deadline:
        sleep(min(limits.DRAIN_POLL_S, max(0.0, deadline - clock())))
    left = [key for key, _ in work.in_flight()]
    if left:
        log.warning("drain: %d request(s) still running at the end of the grace: handed over", len(left))
        work.hand_over(left)
    return plan
