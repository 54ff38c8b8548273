"""The two dispatch policies, asked directly: which pending batch a target gets, which drafter
gets a produced batch (the dispatcher decides when; tests/test_dispatch_dispatcher.py)."""

from dataclasses import dataclass

import pytest

from dflash_ipc.dispatch.buckets import PlannedBatch
from dflash_ipc.dispatch.ledger import Ledger
from dflash_ipc.dispatch.policy import PullPolicy, RoundRobinPolicy, make_policy


@dataclass
class Drafter:
    rank: int
    node: int
    credits: int = 1
    waiting_since: float = 0.0


def ledger_of(num: int) -> Ledger:
    led = Ledger()
    led.add_epoch([PlannedBatch(batch_id=b, epoch=0, bucket=0, sample_ids=(b,), lengths=(4,), padded_len=8)
                   for b in range(num)])
    led.open_pool(0, num)
    return led


def test_pull_serves_requeued_work_first_and_the_longest_waiting_drafter_of_the_node():
    led, pull = ledger_of(4), PullPolicy()
    assert pull.next_batch(3, led).batch_id == 0
    led.lease(0, 0)
    led.lease(1, 0)
    led.drop_target(0)  # 0 and 1 back to pending: served before 2 and 3, oldest first
    assert [pull.next_batch(r, led).batch_id for r in (1, 2)] == [0, 0]
    drafters = [Drafter(0, 0, waiting_since=5.0), Drafter(1, 0, waiting_since=2.0), Drafter(2, 1, waiting_since=1.0),
                Drafter(3, 0, credits=0, waiting_since=0.0)]
    assert pull.drafter_for(7, 0, drafters).rank == 1  # node 0, with credit, waiting longest
    assert pull.drafter_for(7, 1, drafters).rank == 2
    assert pull.drafter_for(7, 2, drafters) is None  # no drafter on that node: the batch waits


def test_round_robin_owns_batches_by_plan_position_whatever_the_speed():
    led = ledger_of(6)
    rr = RoundRobinPolicy(list(range(6)), num_targets=3, num_drafters=2)
    assert [rr.next_batch(r, led).batch_id for r in range(3)] == [0, 1, 2]
    led.lease(0, 0)
    assert rr.next_batch(0, led).batch_id == 3  # target 0's next own batch, never another's
    led.lease(3, 0)
    assert rr.next_batch(0, led) is None and rr.next_batch(1, led).batch_id == 1


def test_round_robin_rotates_over_the_drafters_of_the_producing_node_and_waits_for_the_owner():
    # 2 nodes x 2 drafters: node 0 has ranks 0-1, node 1 ranks 2-3.
    rr = make_policy("round_robin", list(range(8)), num_targets=4, num_drafters=4, num_nodes=2)
    drafters = [Drafter(r, r // 2) for r in range(4)]
    owners = [rr.drafter_for(b, node, drafters).rank for b, node in ((0, 0), (1, 1), (2, 0), (3, 1), (4, 0))]
    assert owners == [0, 2, 1, 3, 0]  # j-th batch of node n -> drafter n*2 + j mod 2
    drafters[1].credits = 0
    assert rr.drafter_for(5, 0, drafters) is None  # its owner has no credit: it waits for it
    drafters[1].credits = 1
    assert rr.drafter_for(5, 0, drafters).rank == 1  # the same owner, once it asks
    rr.forget_drafters()  # a new group: assignments of the old one are void
    assert rr.drafter_for(5, 0, drafters).rank == 0


def test_an_unknown_policy_names_the_allowed_ones():
    with pytest.raises(ValueError, match="policy 'push' not allowed; allowed: pull, round_robin"):
        make_policy("push", [], num_targets=1, num_drafters=1)
