"""Two "nodes" on one machine: two supervisors (`dflash-ipc up --nnodes 2 --node-rank K`), one
dispatcher (node 0's) on loopback tcp, the drafters of both nodes in one torch.distributed
group. A target of node 1 is SIGKILLed mid-run: its supervisor restarts it, the job finishes,
the committed ledger holds every sample exactly once, and every batch was trained on the node
that produced its hidden states.

Everything started is killed by pid in a `finally`, within bounded time.
"""

import json
import os
import signal
import socket
import subprocess
import time

import pytest

from dflash_ipc.config.load import load_config
from dflash_ipc.data.dataset import TokenDataset
from dflash_ipc.dispatch.ledger import BatchState
from dflash_ipc.dispatch.ledger_file import load_ledger
from dflash_ipc.supervise.status_query import fetch_status
from supervised_job import trained_tokens_by_step, CHEAP_STEPS, SMALL_JOB, SupervisedJob

RUN_TIMEOUT_S = 240
START_TIMEOUT_S = 120

# Per node: 2 targets, 1 drafter (4 and 2 in all). A short drafter queue keeps batches pending
# for most of the run: with the small job's queue of 32 sequences the drafters took every
# batch within seconds of the start, and node 1's target could miss the window for its kill.
# Cheaper steps: where batches are trained and how often is the claim, not what a step learns.
# Near the end one node's targets often have nothing left while the other's drafter still has
# batches: each of its steps then waits drafter.max_group_wait_s for the short rank, 1 s here
# (the default 5 s once stretched the end of this job, with the cheaper steps, by ~20 s).
JOB = [*SMALL_JOB, "supervise.max_restarts=3", "drafter.fifo_sequences=8",
       "target.num_workers=2", "drafter.num_workers=1", "drafter.max_group_wait_s=1", *CHEAP_STEPS]


def _two_free_ports() -> int:
    """A port P with P + 1 free too (P: the dispatcher, P + 1: the drafters' rendezvous)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


class Node(SupervisedJob):
    """Node `rank`'s supervisor of the two-node job."""

    def __init__(self, tmp_path, cache_dir, run_dir, rank: int, address: str) -> None:
        self.rank = rank
        tiny = f"target.path={os.path.join(cache_dir, 'tiny-target')}"
        # Without MASTER_* the drafters meet at the dispatcher's host and port + 1.
        super().__init__(run_dir, tmp_path / f"node{rank}.log", cache_dir, [tiny, *JOB],
                         args=["--nnodes", "2", "--node-rank", str(rank), "--dispatcher", address],
                         node_rank=rank, env_drop=("MASTER_ADDR", "MASTER_PORT"))


def _wait_for(predicate, timeout_s: float, what: str, nodes) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for node in nodes:
            assert node.proc.poll() is None, f"node {node.rank} exited early:\n{node.output()[-4000:]}"
        if predicate():
            return
        time.sleep(0.3)
    pytest.fail(f"no {what} within {timeout_s}s:\n" + "\n".join(n.output()[-3000:] for n in nodes))


@pytest.mark.slow
def test_two_nodes_one_dispatcher_exactly_once_and_a_killed_target(tmp_path, tiny_cache):
    run_dir = tmp_path / "run"  # shared by both nodes, as on a cluster's shared filesystem
    address = f"tcp://127.0.0.1:{_two_free_ports()}"
    nodes = [Node(tmp_path, tiny_cache, run_dir, 0, address)]
    try:
        # Node 0 builds the shared assets first (its config exists once they are resolved).
        _wait_for(lambda: (run_dir / "config.yaml").exists(), START_TIMEOUT_S, "node 0 config", nodes)
        nodes.append(Node(tmp_path, tiny_cache, run_dir, 1, address))

        def node1_target_produced():
            try:
                status = fetch_status(str(run_dir), timeout_s=2.0).to_json()  # as JSON, as on disk
            except Exception:  # not serving yet
                return False
            target = status.get("targets", {}).get("3")
            return target is not None and target["batches"] >= 1 and status["batches"]["pending"] > 0

        _wait_for(node1_target_produced, START_TIMEOUT_S, "batch from node 1's target/3", nodes)
        victim = nodes[1].processes()["target/3"]
        os.kill(victim, signal.SIGKILL)

        deadline = time.monotonic() + RUN_TIMEOUT_S
        for node in nodes:
            try:
                code = node.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"node {node.rank} did not finish:\n{node.output()[-4000:]}")
            assert code == 0, f"node {node.rank} exited {code}:\n{node.output()[-5000:]}"
        record = json.loads((run_dir / "processes-node1.json").read_text())
        target3, = [e for e in record["processes"] if e["role"] == "target/3"]
        assert target3["restarts"] == 1 and target3["pid"] != victim

        # Each node ran its own ranks; node 1's config and process record are its own files.
        assert set(nodes[0].processes()) == {"dispatcher", "target/0", "target/1", "drafter/0"}
        assert set(nodes[1].processes()) == {"target/2", "target/3", "drafter/1"}
        assert (run_dir / "config-node1.yaml").exists()

        # Exactly once over the job, and hidden states never left their node.
        cfg = load_config(str(run_dir / "config.yaml"))
        ledger = load_ledger(str(run_dir / "ledger.npz"))
        n = len(TokenDataset(cfg.data.path))
        report = ledger.audit({epoch: range(n) for epoch in range(cfg.data.num_epochs)})
        assert ledger.all_committed() and report.ok, report
        trained_on = {0: 0, 1: 0}
        for entry in ledger.entries():
            assert entry.state is BatchState.COMMITTED
            assert cfg.node_of("target", entry.target) == cfg.node_of("drafter", entry.drafter), entry
            trained_on[cfg.node_of("drafter", entry.drafter)] += 1
        assert trained_on[0] > 0 and trained_on[1] > 0, trained_on  # no node's drafter starved
        # One group across the nodes, never restarted, that trained every token once.
        final = json.loads((run_dir / "final_status.json").read_text())
        assert final["drafter_generation"] == 0
        assert sum(trained_tokens_by_step(run_dir).values()) == int(TokenDataset(cfg.data.path).lengths.sum()) * cfg.data.num_epochs
    finally:
        for node in nodes:
            node.kill_all()
