"""Job configuration: nested dataclasses, filled from YAML and `-o key=value` overrides.

Each section is owned by one component and checked in `__post_init__`; `JobConfig.check()`
adds the checks that span sections. Unknown keys, wrong types and impossible values raise
`ConfigError` naming the dotted key and what is allowed, before anything is started.

    cfg = load_config("configs/default.yaml", ["drafter.lr=3e-4", "target.num_workers=2"])
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from dflash_ipc.errors import ConfigError

DTYPES = ("bfloat16", "float16", "float32")
BUILTIN_TINY_TARGET = "builtin:tiny"
BUILTIN_SYNTHETIC_DATA = "builtin:synthetic"


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


# How a GPU target orders a drafter's read after its writes: transport/cuda_ipc.py says why
# there are two (the transport imports them from here: config stays free of torch).
PUBLISH_SYNC_MODES = ("ipc_event", "host_wait")
PUBLISH_SYNC_CHOICES = ("auto", *PUBLISH_SYNC_MODES)


def gpu_index(device: str) -> int | None:
    """N of a validated 'cuda:N' device (so 'cuda:01' and 'cuda:1' compare equal), else None."""
    return int(device[5:]) if device.startswith("cuda:") else None


def _check_devices(key: str, devices: list[str], num_workers: int) -> None:
    _require(len(devices) in (1, num_workers), key,
             f"give 1 device (shared by all workers) or one per worker ({num_workers}), "
             f"got {len(devices)}")
    for device in devices:
        _require(device == "cpu" or (device.startswith("cuda:") and device[5:].isdigit()),
                 key, f"'{device}' is not a device; allowed: 'cpu' or 'cuda:N'")


@dataclass(kw_only=True, slots=True)
class RunConfig:
    run_dir: str = "runs/default"
    """Where sockets, logs, metrics, ledger and checkpoints of this job live."""
    seed: int = 0
    """Seeds batch order, anchors and drafter init; the same seed gives the same run."""
    log_level: str = "INFO"
    """Python logging level for every process."""
    num_nodes: int = 1
    """Nodes of the job. Each runs `target.num_workers` targets and `drafter.num_workers`
    drafters on its own GPUs (`*.devices` are per node); one dispatcher on node 0 serves all."""
    node_rank: int = 0
    """This node, 0..num_nodes-1 (`dflash-up --node-rank`); node 0 runs the dispatcher."""

    def __post_init__(self) -> None:
        _require(self.log_level in ("DEBUG", "INFO", "WARNING", "ERROR"), "run.log_level",
                 f"'{self.log_level}' not allowed; allowed: DEBUG, INFO, WARNING, ERROR")
        _require(self.num_nodes >= 1, "run.num_nodes", "must be >= 1")
        _require(0 <= self.node_rank < self.num_nodes, "run.node_rank",
                 f"{self.node_rank} outside 0..{self.num_nodes - 1} (run.num_nodes={self.num_nodes})")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    path: str = BUILTIN_SYNTHETIC_DATA
    """Prepared dataset directory (`dflash-ipc prepare`), or builtin:synthetic."""
    synthetic_samples: int = 384
    """builtin:synthetic only: number of conversations generated from the target."""
    synthetic_min_len: int = 24
    """builtin:synthetic only: shortest prompt+response in tokens."""
    synthetic_max_len: int = 384
    """builtin:synthetic only: longest prompt+response in tokens."""
    synthetic_words: int = 48
    """builtin:synthetic only: size of the word vocabulary of the prompts (responses are the
    target's own greedy decoding over its whole vocabulary)."""
    num_epochs: int = 1
    """Passes over the dataset."""
    bucket_boundaries: list[int] = field(default_factory=lambda: [64, 128, 256, 512])
    """Upper length bound of each bucket, increasing; the last is the longest sequence allowed."""
    token_budget: int = 2048
    """Padded tokens per target batch: batch_size x padded_len <= token_budget."""
    pad_multiple: int = 8
    """Padded length of a batch is rounded up to this multiple."""
    max_batch_size: int = 64
    """Most sequences in one target batch."""

    def __post_init__(self) -> None:
        _require(self.num_epochs >= 1, "data.num_epochs", f"must be >= 1, got {self.num_epochs}")
        bounds = self.bucket_boundaries
        _require(len(bounds) >= 1 and all(b > 0 for b in bounds), "data.bucket_boundaries",
                 f"need at least one positive boundary, got {bounds}")
        _require(all(a < b for a, b in zip(bounds, bounds[1:])), "data.bucket_boundaries",
                 f"must be strictly increasing, got {bounds}")
        _require(self.token_budget >= bounds[-1], "data.token_budget",
                 f"{self.token_budget} cannot hold one sequence of the largest bucket "
                 f"({bounds[-1]}); must be >= {bounds[-1]}")
        _require(self.pad_multiple >= 1, "data.pad_multiple", "must be >= 1")
        _require(self.max_batch_size >= 1, "data.max_batch_size", "must be >= 1")
        _require(2 <= self.synthetic_min_len <= self.synthetic_max_len, "data.synthetic_min_len",
                 "need 2 <= synthetic_min_len <= synthetic_max_len")
        _require(self.synthetic_samples >= 1, "data.synthetic_samples", "must be >= 1")
        _require(self.synthetic_words >= 2, "data.synthetic_words", "must be >= 2")

    @property
    def max_length(self) -> int:
        return self.bucket_boundaries[-1]


@dataclass(kw_only=True, slots=True)
class TargetConfig:
    path: str = BUILTIN_TINY_TARGET
    """HF model directory of the frozen target, or builtin:tiny (built on first use)."""
    dtype: str = "bfloat16"
    """Weights and activations of the target; the captured features keep this dtype."""
    attn_implementation: str = "sdpa"
    """Passed to from_pretrained: sdpa, eager, flash_attention_2."""
    num_workers: int = 5
    """Target worker processes."""
    devices: list[str] = field(default_factory=lambda: ["cpu"])
    """One device for all workers or one per worker; several workers may share a GPU."""
    num_slots: int = 4
    """Hidden-state slots per target; a target stalls when all are waiting for drafters."""
    prefetch: int = 2
    """Batches a target asks for ahead of the one it computes (its pull credit)."""
    publish_sync: str = "auto"
    """How a drafter's read is ordered after the target's writes, on GPUs: ipc_event (an
    interprocess event per slot, recorded at publish), host_wait (the target waits for its
    writes before it announces the batch; no interprocess event), or auto: host_wait for a
    target whose GPU also runs drafters, ipc_event otherwise. Why: recording an interprocess
    event makes the next work of the other processes on that GPU wait, ~195-265 us per read
    on an H200 (ipc_event against host_wait reads, docs/benchmarks.md). auto looks at
    drafters only: targets sharing a GPU with each other pay it per batch, not per read
    (noise against a forward pass)."""

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, "target.dtype", f"'{self.dtype}' not allowed; allowed: {DTYPES}")
        allowed = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
        _require(self.attn_implementation in allowed, "target.attn_implementation",
                 f"'{self.attn_implementation}' not allowed; allowed: {allowed}")
        _require(self.num_workers >= 1, "target.num_workers", "must be >= 1")
        _check_devices("target.devices", self.devices, self.num_workers)
        _require(self.num_slots >= 1, "target.num_slots", "must be >= 1")
        _require(1 <= self.prefetch <= self.num_slots, "target.prefetch",
                 f"must be in [1, num_slots={self.num_slots}], got {self.prefetch}")
        _require(self.publish_sync in PUBLISH_SYNC_CHOICES, "target.publish_sync",
                 f"'{self.publish_sync}' not allowed; allowed: {PUBLISH_SYNC_CHOICES}")

    def device_of(self, rank: int) -> str:
        """The device of global rank `rank`: devices are per node, ranks count across nodes."""
        return self.devices[rank % self.num_workers if len(self.devices) > 1 else 0]


@dataclass(kw_only=True, slots=True)
class DrafterConfig:
    num_workers: int = 3
    """Drafter processes; they form one torch.distributed group and step in lockstep."""
    devices: list[str] = field(default_factory=lambda: ["cpu"])
    """One device for all drafters or one per drafter."""
    dtype: str = "bfloat16"
    """Compute dtype of the drafter (master weights and optimizer state stay float32)."""
    num_layers: int = 5
    """Drafter decoder layers."""
    target_layer_ids: list[int] | None = None
    """Target layers whose outputs are captured; default: the paper's spacing."""
    block_size: int = 16
    """Tokens drafted per block (anchor token + block_size-1 masks)."""
    mask_token_id: int | None = None
    """Id of the mask token; default: the target tokenizer's mask token."""
    max_anchors_per_seq: int = 512
    """Most anchors sampled in one sequence."""
    anchors_per_step: int = 2048
    """Anchors (blocks) per optimizer step on each drafter; fixes the step's cost."""
    gamma: float = 7.0
    """Loss weight of block position k is exp(-(k-1)/gamma)."""
    lr: float = 6e-4
    """Peak AdamW learning rate."""
    min_lr_ratio: float = 0.0
    """Cosine schedule ends at lr * min_lr_ratio."""
    warmup_ratio: float = 0.04
    """Fraction of steps of linear warmup."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    attention: str = "auto"
    """auto (flex on GPU, dense on CPU), flex or dense."""
    checkpoint_every_steps: int = 200
    """Steps between checkpoints (rank 0 writes); one is always written at the end."""
    fifo_sequences: int = 256
    """Drafter asks for hidden states while fewer sequences than this wait in its queue."""
    prefetch: int = 2
    """Assignments a drafter may have outstanding (its pull credit)."""

    def __post_init__(self) -> None:
        _require(self.num_workers >= 1, "drafter.num_workers", "must be >= 1")
        _check_devices("drafter.devices", self.devices, self.num_workers)
        _require(self.dtype in DTYPES, "drafter.dtype", f"'{self.dtype}' not allowed; allowed: {DTYPES}")
        _require(self.num_layers >= 1, "drafter.num_layers", "must be >= 1")
        _require(self.block_size >= 2, "drafter.block_size", "must be >= 2")
        _require(self.max_anchors_per_seq >= 1, "drafter.max_anchors_per_seq", "must be >= 1")
        _require(self.anchors_per_step >= 1, "drafter.anchors_per_step", "must be >= 1")
        _require(self.gamma > 0, "drafter.gamma", "must be > 0")
        _require(self.lr > 0, "drafter.lr", "must be > 0")
        _require(0.0 <= self.min_lr_ratio <= 1.0, "drafter.min_lr_ratio", "must be in [0, 1]")
        _require(0.0 <= self.warmup_ratio < 1.0, "drafter.warmup_ratio", "must be in [0, 1)")
        _require(self.grad_clip > 0, "drafter.grad_clip", "must be > 0")
        _require(self.attention in ("auto", "flex", "dense"), "drafter.attention",
                 f"'{self.attention}' not allowed; allowed: auto, flex, dense")
        _require(self.checkpoint_every_steps >= 1, "drafter.checkpoint_every_steps", "must be >= 1")
        _require(self.fifo_sequences >= 1, "drafter.fifo_sequences", "must be >= 1")
        _require(self.prefetch >= 1, "drafter.prefetch", "must be >= 1")
        if self.target_layer_ids is not None:
            _require(len(self.target_layer_ids) >= 1 and min(self.target_layer_ids) >= 0,
                     "drafter.target_layer_ids", "need non-negative layer indices")

    def device_of(self, rank: int) -> str:
        """The device of global rank `rank`: devices are per node, ranks count across nodes."""
        return self.devices[rank % self.num_workers if len(self.devices) > 1 else 0]


@dataclass(kw_only=True, slots=True)
class DispatchConfig:
    policy: str = "pull"
    """pull (workers ask for work) or round_robin (the push baseline, for benchmarks)."""
    address: str = ""
    """ZMQ address of the dispatcher; empty: ipc:// socket in the run directory."""
    status_interval_s: float = 5.0
    """Seconds between status lines of the supervisor."""
    heartbeat_interval_s: float = 1.0
    """Seconds between heartbeats, both ways."""
    heartbeat_timeout_s: float = 30.0
    """A worker silent this long is declared dead (hung) and its work requeued."""

    def __post_init__(self) -> None:
        _require(self.policy in ("pull", "round_robin"), "dispatch.policy",
                 f"'{self.policy}' not allowed; allowed: pull, round_robin")
        if self.address:
            _require(self.address.startswith(("ipc://", "tcp://")), "dispatch.address",
                     f"'{self.address}' must start with ipc:// or tcp://")
        _require(self.status_interval_s > 0, "dispatch.status_interval_s", "must be > 0")
        _require(self.heartbeat_interval_s > 0, "dispatch.heartbeat_interval_s", "must be > 0")
        _require(self.heartbeat_timeout_s > 2 * self.heartbeat_interval_s,
                 "dispatch.heartbeat_timeout_s", "must exceed 2 x heartbeat_interval_s")


@dataclass(kw_only=True, slots=True)
class SuperviseConfig:
    startup_timeout_s: float = 300.0
    """Each worker must register with the dispatcher within this time."""
    grace_s: float = 10.0
    """SIGTERM -> wait this long -> SIGKILL."""
    max_restarts: int = 3
    """Restarts allowed per window, per target rank, for the drafter group and for the
    dispatcher, before the job fails (0: any death fails the job)."""
    restart_window_s: float = 600.0
    """Window of the restart count."""
    drafter_timeout_s: float = 300.0
    """A drafter silent this long is hung and its group restarts: every step (the first,
    compiled one included) and every checkpoint must finish within it."""
    stop_timeout_s: float = 120.0
    """On SIGINT/SIGTERM the drafters get this long to checkpoint and commit before
    everything is stopped."""

    def __post_init__(self) -> None:
        _require(self.startup_timeout_s > 0, "supervise.startup_timeout_s", "must be > 0")
        _require(self.grace_s >= 0, "supervise.grace_s", "must be >= 0")
        _require(self.max_restarts >= 0, "supervise.max_restarts", "must be >= 0")
        _require(self.drafter_timeout_s > 0, "supervise.drafter_timeout_s", "must be > 0")
        _require(self.stop_timeout_s >= 0, "supervise.stop_timeout_s", "must be >= 0")


@dataclass(kw_only=True, slots=True)
class JobConfig:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    supervise: SuperviseConfig = field(default_factory=SuperviseConfig)

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Checks that span sections."""
        uses_cuda = any(d.startswith("cuda") for d in self.target.devices + self.drafter.devices)
        _require(not (uses_cuda and any(d == "cpu" for d in self.target.devices + self.drafter.devices)),
                 "target.devices/drafter.devices",
                 "mixing cpu and cuda workers is not supported (hidden states move by CUDA IPC "
                 "between GPUs, by shared memory between CPU processes)")
        if self.run.num_nodes > 1:
            _require(self.dispatch.address.startswith("tcp://"), "dispatch.address",
                     f"run.num_nodes={self.run.num_nodes}: the dispatcher must listen on tcp://HOST:PORT "
                     f"reachable from every node (dflash-up --dispatcher), got '{self.dispatch.address}'")

    # Ranks are global: node k runs targets k*T..k*T+T-1 and drafters k*D..k*D+D-1.
    @property
    def total_targets(self) -> int:
        return self.run.num_nodes * self.target.num_workers

    @property
    def total_drafters(self) -> int:
        return self.run.num_nodes * self.drafter.num_workers

    def local_ranks(self, role: str) -> range:
        """The global ranks of `role` ("target" | "drafter") that this node runs."""
        per_node = self.target.num_workers if role == "target" else self.drafter.num_workers
        return range(self.run.node_rank * per_node, (self.run.node_rank + 1) * per_node)

    def publish_sync_of(self, rank: int) -> str:
        """Target `rank`'s slot publish mode, with `auto` resolved (see TargetConfig)."""
        if self.target.publish_sync != "auto":
            return self.target.publish_sync
        gpu = gpu_index(self.target.device_of(rank))
        shares_gpu = gpu is not None and gpu in {gpu_index(d) for d in self.drafter.devices}
        return "host_wait" if shares_gpu else "ipc_event"

    def node_of(self, role: str, rank: int) -> int:
        return rank // (self.target.num_workers if role == "target" else self.drafter.num_workers)

    @property
    def dispatcher_address(self) -> str:
        return self.dispatch.address or f"ipc://{os.path.abspath(self.run.run_dir)}/dispatcher.sock"


# --- YAML and overrides -------------------------------------------------------------------


def _convert(value: Any, hint: Any, key: str) -> Any:
    """Checks `value` against a type hint, converting the few lossless cases (int -> float)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(value, inner, key)
    if origin is list:
        (inner,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_convert(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        # YAML 1.1 reads "6e-4" (no dot) as a string; accept any spelling float() takes.
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{key}: expected float, got str {value!r}") from None
    if hint in (int, float, str, bool) and not (isinstance(value, hint) and
                                                 not (hint is int and isinstance(value, bool))):
        raise ConfigError(f"{key}: expected {hint.__name__}, got {type(value).__name__} {value!r}")
    if hint is dict and not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a mapping, got {value!r}")
    return value


def _build(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"unknown key {where}{unknown[0]}; allowed keys: {', '.join(sorted(names))}")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, key)
        else:
            kwargs[name] = _convert(value, hint, key)
    return cls(**kwargs)


def _apply_override(tree: dict, override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override '{override}' must look like section.key=value")
    dotted, raw = override.split("=", 1)
    parts = dotted.strip().split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{override}': {part} is not a section")
    # YAML parsing gives ints, floats, bools, lists ("[64,128]") and null the natural way.
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""


def config_from_dict(data: dict) -> JobConfig:
    return _build(JobConfig, data, "")


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Reads YAML (or the defaults when path is None), applies `key=value` overrides, validates."""
    tree: dict = {}
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                tree = yaml.safe_load(f) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
    for override in overrides:
        _apply_override(tree, override)
    try:
        return config_from_dict(tree)
    except ConfigError as exc:
        raise ConfigError(f"{path or 'defaults'}: {exc}") from None


def config_to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def dump_config(cfg: JobConfig, path: str) -> None:
    """Writes the resolved config, so every worker and a later audit see the same job."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        yaml.safe_dump(config_to_dict(cfg), f, sort_keys=False)
    os.replace(tmp, path)
