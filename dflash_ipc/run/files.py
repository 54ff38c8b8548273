"""Every file of a run directory, named in one place.

    files = RunFiles("runs/qwen3-8b", node_rank=0)
    files.ledger          # runs/qwen3-8b/ledger.npz
    files.log("target/3") # runs/qwen3-8b/logs/target-3.log

Files a node of a multi-node job writes carry its rank where the nodes would collide on a
shared run directory (`config-node1.yaml`, `processes-node1.json`); node 0's are the job's.
Checkpoint directories have their own layout (`drafter/checkpoint_store.py`).
"""

from __future__ import annotations

import hashlib
import os
import tempfile

# A Unix socket path is at most 107 bytes (sun_path of 108 with its NUL) on Linux.
MAX_SOCKET_PATH = 107


def shared_socket_dir() -> str:
    """Where the sockets of run directories with long paths live: a folder of this user in the
    temp directory (which every user may write, so the dispatcher checks who owns it)."""
    return os.path.join(tempfile.gettempdir(), f"dflash-ipc-{os.getuid()}")


def node_file(run_dir: str, name: str, node_rank: int) -> str:
    """`run_dir/name` for node 0, `run_dir/<stem>-node<K><ext>` for node K."""
    if node_rank == 0:
        return os.path.join(run_dir, name)
    stem, ext = os.path.splitext(name)
    return os.path.join(run_dir, f"{stem}-node{node_rank}{ext}")


def role_file_name(role: str) -> str:
    """`target/3` -> `target-3`: a role as part of a file name."""
    return role.replace("/", "-")


class RunFiles:
    """Paths of one run directory, as seen by one node."""

    def __init__(self, run_dir: str, node_rank: int = 0, num_nodes: int = 1) -> None:
        self.run_dir = os.path.abspath(run_dir)
        self.node_rank = node_rank
        self.num_nodes = num_nodes

    def _path(self, *parts: str) -> str:
        return os.path.join(self.run_dir, *parts)

    # --- written by the supervisor ---------------------------------------------------------
    @property
    def config(self) -> str:
        """The resolved config this node's processes run with (node 0's is the job's)."""
        return node_file(self.run_dir, "config.yaml", self.node_rank)

    @property
    def job_config(self) -> str:
        """Node 0's resolved config: what status, health and audits read."""
        return node_file(self.run_dir, "config.yaml", 0)

    @property
    def processes(self) -> str:
        """Supervisor pid and each child's role, pid and log (read by health)."""
        return node_file(self.run_dir, "processes.json", self.node_rank)

    @property
    def tensorboard(self) -> str:
        return self._path("tensorboard")

    @property
    def wandb(self) -> str:
        """The W&B run files (`wandb/`, made by the wandb package; offline runs stay there)."""
        return self._path("wandb")

    @property
    def wandb_run(self) -> str:
        """The job's W&B run id and next history step: a resumed job continues that run."""
        return self._path("wandb_run.json")

    @property
    def status_history(self) -> str:
        """One JSON line per status poll: rates, counters and each worker's memory (read by report)."""
        return self._path("status_history.jsonl")

    @property
    def logs(self) -> str:
        return self._path("logs")

    def log(self, role: str) -> str:
        return self._path("logs", f"{role_file_name(role)}.log")

    # --- written by the dispatcher ---------------------------------------------------------
    @property
    def ledger(self) -> str:
        return self._path("ledger.npz")

    @property
    def final_status(self) -> str:
        """The dispatcher's status at the end of the job, with whole-run average rates."""
        return self._path("final_status.json")

    @property
    def drafter_generation(self) -> str:
        """The last drafter-group generation used (a restarted dispatcher starts one past)."""
        return self._path("drafter_generation")

    @property
    def socket(self) -> str:
        """The dispatcher's ipc:// socket (when dispatch.address is empty). A run directory
        whose path would make the socket path too long for Unix sockets gets a short path
        under the temp directory, derived from the run directory (every process agrees)."""
        path = self._path("dispatcher.sock")
        if len(path.encode()) <= MAX_SOCKET_PATH:
            return path
        tag = hashlib.sha1(self.run_dir.encode()).hexdigest()[:16]
        return os.path.join(shared_socket_dir(), f"{tag}.sock")

    @property
    def curve_keys(self) -> str:
        """The job's CURVE key pairs (tcp:// dispatchers), mode 0700."""
        return self._path("keys")

    @property
    def job_secret(self) -> str:
        """The job's secret (mode 0600): a Register for a target or drafter seat carries it."""
        return self._path("keys", "job_secret")

    # --- written by the workers ------------------------------------------------------------
    @property
    def checkpoints(self) -> str:
        return self._path("checkpoints")

    @property
    def metrics(self) -> str:
        """Per-worker timelines: `metrics/<role>.jsonl`."""
        return self._path("metrics")

    def timeline(self, role: str) -> str:
        return self._path("metrics", f"{role_file_name(role)}.jsonl")

    def beacon(self, role: str) -> str:
        """A worker's liveness beacon (`liveness.py`), read by its node's supervisor."""
        return self._path("beacons", role_file_name(role))

    @property
    def drafter_metrics(self) -> str:
        """Drafter rank 0: one JSON line per optimizer step."""
        return self._path("drafter_metrics.jsonl")

    # --- shared-memory segments (CPU slot pools), named after the run directory -----------
    @property
    def tag(self) -> str:
        """Short stable id of the run directory."""
        return hashlib.sha1(self.run_dir.encode()).hexdigest()[:10]

    @property
    def shm_prefix(self) -> str:
        """What this node's segment names start with (`-n<K>` on node K of several nodes)."""
        node = f"-n{self.node_rank}" if self.num_nodes > 1 else ""
        return f"dflash-{self.tag}{node}"

    def pool_name(self, target_rank: int) -> str:
        return f"{self.shm_prefix}-t{target_rank}"

    @property
    def segments_prefix(self) -> str:
        """The sweep prefix: every segment of this node starts with it, and no other's
        (`shm_prefix` alone is not one: node 1's `...-n1` also starts node 10's names)."""
        return f"{self.shm_prefix}-t"

    # --- written by tools ------------------------------------------------------------------
    @property
    def report_png(self) -> str:
        return self._path("report.png")

    @property
    def report_json(self) -> str:
        """The numbers `report.png` draws."""
        return self._path("report.json")

    @property
    def eval_results(self) -> str:
        """`dflash-ipc eval --save-to RUN_DIR`: one JSON line per evaluated drafter (eval_results.py)."""
        return self._path("eval_results.jsonl")

    @property
    def health_state(self) -> str:
        """Progress counters kept by `dflash-ipc health` between calls (per node)."""
        return node_file(self.run_dir, "health_state.json", self.node_rank)
