"""Whom the dispatcher serves: a small policy object (`Dispatcher(policy=...)`).

The dispatcher decides *when* (a worker with credit asked) and the ledger records *what*
happened; a policy only answers two questions: which pending batch a target that asked
gets next, and which drafter that asked gets a produced batch.

pull (the default): the oldest pending batch (requeued first) to whichever target asks; a
produced batch to the drafter of the producing node that has waited longest. A slow target
simply asks less often, so no batch waits behind a busy worker while another idles.

round_robin (the reference system, a benchmark baseline): batch i of the plan belongs to
target i mod N from the start and the j-th batch produced on a node to that node's drafter
j mod M, whatever their speed. Workers still receive only with credit, so a comparison
measures the assignment policy, not flow control.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from dflash_ipc.dispatch.buckets import PlannedBatch
from dflash_ipc.dispatch.ledger import Ledger

POLICIES = ("pull", "round_robin")  # round_robin: the push baseline of `bench dispatch` only


class DrafterView(Protocol):
    """What a policy reads of a drafter seat."""
    rank: int
    node: int
    credits: int
    waiting_since: float


class Policy(Protocol):
    name: str

    def next_batch(self, target_rank: int, ledger: Ledger) -> PlannedBatch | None:
        """The pending batch target `target_rank` gets now, or None."""

    def drafter_for(self, batch_id: int, node: int, drafters: Sequence[DrafterView]) -> DrafterView | None:
        """The drafter (with credit) that gets produced batch `batch_id` of `node`, or None."""

    def forget_drafters(self) -> None:
        """The drafter group restarted: assignments decided for the old group are void."""


class PullPolicy:
    name = "pull"

    def next_batch(self, target_rank: int, ledger: Ledger) -> PlannedBatch | None:
        return ledger.next_pending()

    def drafter_for(self, batch_id: int, node: int, drafters: Sequence[DrafterView]) -> DrafterView | None:
        # Hidden states never leave their node: only drafters of the producing node qualify.
        ready = [d for d in drafters if d.credits > 0 and d.node == node]
        return min(ready, key=lambda d: d.waiting_since) if ready else None

    def forget_drafters(self) -> None:
        pass


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self, plan_order: Sequence[int], *, num_targets: int, num_drafters: int, num_nodes: int = 1) -> None:
        # Drafter ranks are global: node k's are k*D .. k*D+D-1 (config.node_of).
        self.drafters_per_node = num_drafters // num_nodes
        self.target_of = {bid: i % num_targets for i, bid in enumerate(plan_order)}
        self.drafter_of: dict[int, int] = {}
        self.produced_on: dict[int, int] = {}  # node -> batches produced there so far

    def next_batch(self, target_rank: int, ledger: Ledger) -> PlannedBatch | None:
        return next((b for b in ledger.pending_batches() if self.target_of[b.batch_id] == target_rank), None)

    def drafter_for(self, batch_id: int, node: int, drafters: Sequence[DrafterView]) -> DrafterView | None:
        if batch_id not in self.drafter_of:
            # Hidden states never leave their node: the rotation runs over its drafters.
            j = self.produced_on.get(node, 0)
            self.drafter_of[batch_id] = node * self.drafters_per_node + j % self.drafters_per_node
            self.produced_on[node] = j + 1
        owner = next((d for d in drafters if d.rank == self.drafter_of[batch_id]), None)
        return owner if owner is not None and owner.credits > 0 else None

    def forget_drafters(self) -> None:
        self.drafter_of.clear()


def make_policy(name: str, plan_order: Sequence[int], *, num_targets: int, num_drafters: int,
                num_nodes: int = 1) -> Policy:
    if name == "pull":
        return PullPolicy()
    if name == "round_robin":
        return RoundRobinPolicy(plan_order, num_targets=num_targets, num_drafters=num_drafters, num_nodes=num_nodes)
    raise ValueError(f"policy '{name}' not allowed; allowed: {', '.join(POLICIES)}")
