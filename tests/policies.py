"""A load-aware policy for tests that must see trees grown and verified on every step."""

from __future__ import annotations

from specinfer.engine.scheduling.policy import CostModel, LoadAwarePolicy
from specinfer.params import TreeBudget

CHEAP = TreeBudget(max_nodes=24, max_depth=6, node_cost=0.002, level_cost=0.01)


class FixedBudget(LoadAwarePolicy):
    """Every step gets the same dynamic-tree budget (the load-aware policy's pricing left out)."""

    def __init__(self, budget: TreeBudget = CHEAP):
        super().__init__(CostModel([(1, 0.01), (64, 0.02)]))
        self.fixed = budget

    def choose(self, batch_size, is_greedy=True, pool=()):
        return self.fixed
