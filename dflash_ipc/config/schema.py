"""Job configuration: one small dataclass per component, filled from YAML and overrides.

Sections, as torchtitan splits them: `run`, `data`, `target` (the target workers), `drafter`
(the drafter workers: devices, precision, flow control), `model` (the drafter's shape),
`optimizer`, `schedule`, `objective`, `checkpoint`, `validation` (scoring during training),
`dispatch`, `supervise`, `metrics` (the trackers the supervisor writes to). Each section
checks its fields in `__post_init__`; `JobConfig.check()` adds the checks that span
sections. Choices are `Literal` types; floats must be finite. YAML reading, overrides and
the keys of older versions live in `config_load.py`.

    cfg = load_config("configs/default.yaml", ["optimizer.lr=3e-4", "target.num_workers=2"])
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Literal

from dflash_ipc.config.addresses import check_address
from dflash_ipc.errors import ConfigError
from dflash_ipc.run.files import RunFiles

DType = Literal["bfloat16", "float16", "float32"]
DTYPE_NAMES: tuple[str, ...] = typing.get_args(DType)
Attention = Literal["auto", "flex", "dense"]
Precision = Literal["bf16", "fp8"]
Fp8Recipe = Literal["tensorwise", "rowwise", "delayed"]
Fp8HeadMatmuls = Literal["auto", "all", "grad", "none"]
AttnImplementation = Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
Auth = Literal["auto", "curve", "none"]
# How a GPU target orders a drafter's read after its writes: transport/cuda_ipc.py says why
# there are two (the transport imports them from here: config stays free of torch).
PublishMode = Literal["ipc_event", "host_wait"]
PUBLISH_SYNC_MODES: tuple[str, ...] = typing.get_args(PublishMode)
PublishSync = Literal["auto", "ipc_event", "host_wait"]
Sharding = Literal["none", "fsdp"]
LayerType = Literal["full_attention", "sliding_attention"]
LAYER_TYPES: tuple[str, ...] = typing.get_args(LayerType)
LAYER_TYPE_LETTERS = {"F": "full_attention", "S": "sliding_attention"}  # model.layer_types' compact form
Weighting = Literal["decay", "dpace"]
OptimizerName = Literal["adamw", "muon"]
MuonAdjustLr = Literal["match_rms_adamw", "original"]
ScheduleName = Literal["cosine", "wsd"]
DecayShape = Literal["linear", "cosine", "sqrt"]
Compile = Literal["off", "default", "max-autotune-no-cudagraphs", "reduce-overhead"]
MetricSink = Literal["tensorboard", "wandb"]
METRIC_SINKS: tuple[str, ...] = typing.get_args(MetricSink)
WandbMode = Literal["online", "offline", "disabled"]
WANDB_MODES: tuple[str, ...] = typing.get_args(WandbMode)
WANDB_NAME_FORBIDDEN = "/\\#?%:"  # characters W&B refuses in project and entity names
WANDB_MAX_TAG = 64                 # W&B's longest tag

BUILTIN_TINY_TARGET = "builtin:tiny"
BUILTIN_SYNTHETIC_DATA = "builtin:synthetic"
MAX_SEED = 2**32 - 1       # numpy and torch seeds
MAX_TOKENS = 1 << 22       # token budgets, bucket bounds: far above any real batch (4M tokens)
MAX_BLOCK_SIZE = 1024      # drafter block: DFlash uses 16; a verify step holds [rows, block, vocab] logits, so a
                           # block of 100,000 (a typo in a config.json) runs out of memory rather than failing


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


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


def _check_group_devices(devices: list[str], num_workers: int, k: int) -> None:
    """target.devices of K-process workers: one 'cpu' for all, or K distinct GPUs per worker."""
    key = "target.devices"
    want = num_workers * k
    if len(devices) == 1:
        _require(devices[0] == "cpu", key,
                 f"with target.gpus_per_worker={k}, list {num_workers} x {k} = {want} GPUs (worker r on "
                 f"devices[r*{k}:(r+1)*{k}]); one GPU cannot hold the {k} ranks of a worker, got {devices}")
        return
    _require(len(devices) == want, key, f"with target.gpus_per_worker={k} and target.num_workers={num_workers}, "
             f"list {want} devices (worker r on devices[r*{k}:(r+1)*{k}]), got {len(devices)}")
    _check_devices(key, devices, want)  # the allowed device names
    _require(all(d.startswith("cuda:") for d in devices), key,
             f"with target.gpus_per_worker={k}, all GPUs ('cuda:N') or one 'cpu', got {devices}")
    seen = {}
    for i, d in enumerate(devices):
        _require(gpu_index(d) not in seen, key, f"{d} is listed twice (positions {seen.get(gpu_index(d))} and {i}): "
                 f"each GPU holds one rank of one target worker")
        seen[gpu_index(d)] = i


def check_field_types(section: object, name: str) -> None:
    """Choices (`Literal`) and finite floats of a section, whoever built it (YAML or code)."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        value, hint = getattr(section, f.name), hints[f.name]
        if typing.get_origin(hint) is Literal:
            allowed = typing.get_args(hint)
            _require(value in allowed, f"{name}.{f.name}",
                     f"{value!r} not allowed; allowed: {', '.join(map(str, allowed))}")
        elif hint is float:
            _require(isinstance(value, (int, float)) and math.isfinite(value), f"{name}.{f.name}",
                     f"must be a finite number, got {value!r}")


class _Section:
    """Base of every section: type checks, then the section's own `check()`."""
    __slots__ = ()
    NAME: typing.ClassVar[str] = ""

    def __post_init__(self) -> None:
        check_field_types(self, self.NAME)
        self.check()

    def check(self) -> None:
        """The section's own value checks (ConfigError naming the dotted key)."""


@dataclass(kw_only=True, slots=True)
class RunConfig(_Section):
    NAME = "run"
    run_dir: str = "runs/default"
    """Where sockets, logs, metrics, ledger and checkpoints of this job live."""
    seed: int = 0
    """Seeds batch order, anchors and drafter init; the same seed gives the same run."""
    log_level: LogLevel = "INFO"
    """Python logging level for every process."""
    num_nodes: int = 1
    """Nodes of the job. Each runs `target.num_workers` targets and `drafter.num_workers`
    drafters on its own GPUs (`*.devices` are per node); one dispatcher on node 0 serves all."""
    node_rank: int = 0
    """This node, 0..num_nodes-1 (`dflash-up --node-rank`); node 0 runs the dispatcher."""

    def check(self) -> None:
        _require(self.run_dir.strip() != "", "run.run_dir", "must name a directory, got ''")
        _require(0 <= self.seed <= MAX_SEED, "run.seed", f"must be in [0, {MAX_SEED}], got {self.seed}")
        _require(1 <= self.num_nodes <= 4096, "run.num_nodes", f"must be in [1, 4096], got {self.num_nodes}")
        _require(0 <= self.node_rank < self.num_nodes, "run.node_rank",
                 f"{self.node_rank} outside 0..{self.num_nodes - 1} (run.num_nodes={self.num_nodes})")


@dataclass(kw_only=True, slots=True)
class BuiltinConfig(_Section):
    """The embedded default's synthetic data (`data.path: builtin:synthetic`); read by nothing else."""
    NAME = "builtin"
    samples: int = 384
    """Conversations generated from the target."""
    min_len: int = 24
    """Shortest prompt+response in tokens."""
    max_len: int = 384
    """Longest prompt+response in tokens."""
    words: int = 48
    """Size of the word vocabulary of the prompts (responses are the target's own greedy
    decoding over its whole vocabulary)."""

    def check(self) -> None:
        _require(2 <= self.min_len <= self.max_len <= MAX_TOKENS, "builtin.min_len",
                 f"need 2 <= builtin.min_len <= builtin.max_len <= {MAX_TOKENS}")
        _require(self.samples >= 1, "builtin.samples", "must be >= 1")
        _require(self.words >= 2, "builtin.words", "must be >= 2")


@dataclass(kw_only=True, slots=True)
class DataConfig(_Section):
    NAME = "data"
    path: str = BUILTIN_SYNTHETIC_DATA
    """Prepared dataset directory (`dflash-ipc prepare`), or builtin:synthetic."""
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

    def check(self) -> None:
        _require(1 <= self.num_epochs <= 10_000, "data.num_epochs", f"must be in [1, 10000], got {self.num_epochs}")
        bounds = self.bucket_boundaries
        _require(len(bounds) >= 1 and all(0 < b <= MAX_TOKENS for b in bounds), "data.bucket_boundaries",
                 f"need at least one boundary in [1, {MAX_TOKENS}], got {bounds}")
        _require(all(a < b for a, b in zip(bounds, bounds[1:])), "data.bucket_boundaries",
                 f"must be strictly increasing, got {bounds}")
        _require(bounds[-1] <= self.token_budget <= MAX_TOKENS, "data.token_budget",
                 f"{self.token_budget} must hold one sequence of the largest bucket ({bounds[-1]}) "
                 f"and be <= {MAX_TOKENS}")
        _require(1 <= self.pad_multiple <= 4096, "data.pad_multiple", "must be in [1, 4096]")
        _require(1 <= self.max_batch_size <= 65536, "data.max_batch_size", "must be in [1, 65536]")

    @property
    def max_length(self) -> int:
        return self.bucket_boundaries[-1]


@dataclass(kw_only=True, slots=True)
class TargetConfig(_Section):
    NAME = "target"
    path: str = BUILTIN_TINY_TARGET
    """HF model directory of the frozen target, or builtin:tiny (built on first use)."""
    dtype: DType = "bfloat16"
    """Weights and activations of the target; the captured features keep this dtype."""
    attn_implementation: AttnImplementation = "sdpa"
    """Passed to from_pretrained."""
    num_workers: int = 5
    """Target workers; each is `gpus_per_worker` processes (one seat for the dispatcher)."""
    gpus_per_worker: int = 1
    """Processes (devices) of one target worker: K > 1 loads the target with transformers'
    tensor parallelism over its K devices (target/tensor_parallel.py); one K-process worker
    is one seat, its rank 0 (the leader) owns the slot pool."""
    expert_parallel: bool = False
    """gpus_per_worker > 1 and a MoE target: place whole experts on the ranks (transformers'
    expert-parallel plan) instead of splitting every expert's matrices."""
    devices: list[str] = field(default_factory=lambda: ["cpu"])
    """One device for all workers or one per worker; several workers may share a GPU. With
    gpus_per_worker K > 1: num_workers x K GPUs, worker r on devices[r*K:(r+1)*K] (each GPU
    used once), or one 'cpu' for all."""
    num_slots: int = 4
    """Hidden-state slots per target; a target stalls when all are waiting for drafters."""
    prefetch: int = 2
    """Batches a target asks for ahead of the one it computes (its pull credit)."""
    publish_sync: PublishSync = "auto"
    """How a drafter's read is ordered after the target's writes, on GPUs: ipc_event (an
    interprocess event per slot, recorded at publish), host_wait (the target waits for its
    writes before it announces the batch; no interprocess event), or auto: host_wait for a
    target whose GPU also runs drafters, ipc_event otherwise. Why: recording an interprocess
    event makes the next work of the other processes on that GPU wait, ~214-265 us per read
    on an H200 (ipc_event against host_wait reads, docs/benchmarks.md). auto looks at
    drafters only: targets sharing a GPU with each other pay it per batch, not per read
    (noise against a forward pass)."""

    def check(self) -> None:
        _require(1 <= self.num_workers <= 1024, "target.num_workers", "must be in [1, 1024]")
        _require(1 <= self.gpus_per_worker <= 64, "target.gpus_per_worker", "must be in [1, 64]")
        if self.gpus_per_worker == 1:
            _check_devices("target.devices", self.devices, self.num_workers)
        else:
            _check_group_devices(self.devices, self.num_workers, self.gpus_per_worker)
        _require(not self.expert_parallel or self.gpus_per_worker > 1, "target.expert_parallel",
                 "needs target.gpus_per_worker > 1 (experts are placed across the ranks of one worker)")
        _require(1 <= self.num_slots <= 256, "target.num_slots", "must be in [1, 256]")
        _require(1 <= self.prefetch <= self.num_slots, "target.prefetch",
                 f"must be in [1, num_slots={self.num_slots}], got {self.prefetch}")

    def devices_of(self, rank: int) -> list[str]:
        """The `gpus_per_worker` devices of global target rank `rank`, its leader's first.
        Devices are per node, ranks count across nodes."""
        k = self.gpus_per_worker
        if len(self.devices) == 1:
            return self.devices * k
        first = (rank % self.num_workers) * k
        return self.devices[first:first + k]

    def device_of(self, rank: int) -> str:
        """The device of target rank `rank`'s leader (its only process when gpus_per_worker
        is 1): where its slot pool lives."""
        return self.devices_of(rank)[0]


@dataclass(kw_only=True, slots=True)
class DrafterConfig(_Section):
    NAME = "drafter"
    num_workers: int = 3
    """Drafter processes; they form one torch.distributed group and step in lockstep."""
    devices: list[str] = field(default_factory=lambda: ["cpu"])
    """One device for all drafters or one per drafter."""
    dtype: DType = "bfloat16"
    """Compute dtype of the drafter (master weights and optimizer state stay float32)."""
    attention: Attention = "auto"
    """auto (flex on GPU, dense on CPU), flex or dense."""
    precision: Precision = "bf16"
    """Training matmuls: bf16, or fp8 (linear layers and LM head in float8: drafter/precision.py)."""
    fp8_recipe: Fp8Recipe = "tensorwise"
    """fp8 only: one scale per tensor (tensorwise), one per row (rowwise), both torchao's, or
    delayed: tensorwise's formats with each layer's input and gradient scale from their
    abs-max over the last 16 steps, cast in one pass (drafter/float8_delayed.py; needs
    drafter.compile off and sharding none; no torchao)."""
    fp8_lm_head: Fp8HeadMatmuls = "auto"
    """fp8 only: the frozen LM head's matmuls in float8: all (logits, dL/dh), grad (dL/dh) or none;
    auto: all with objective.weighting decay, none with dpace (whose per-row CE runs in the
    head's own dtype)."""
    fp8_layers: bool = True
    """fp8 only: the drafter's linear layers in float8 (torchao Float8Linear); false keeps them
    bf16 and puts only the LM head's matmuls (fp8_lm_head) in float8: for small drafters,
    whose float8 casts cost more than the layers' float8 matmuls save (a 135M-class target's
    hidden 576: docs/benchmarks.md) while the head is most of the step's FLOPs."""
    fp8_shared_casts: bool = False
    """fp8 only: the layers that read one input (q/k/v of the block, k/v of the context,
    gate/up) as one float8 matmul over their concatenated weights, so the input is cast to
    float8 once (drafter/precision.py, SharedInputFloat8: 0.8 GiB less at the Qwen3-8B shape,
    no step time saved on an H100); false (default): each layer on its own."""
    fifo_sequences: int = 256
    """A drafter asks for hidden states while fewer sequences than this wait in its queue."""
    prefetch: int = 2
    """Assignments a drafter may have outstanding (its pull credit)."""
    max_group_wait_s: float = 5.0
    """A full drafter that has waited this long for a short one (its node has no hidden states
    ready) steps anyway, the short one with what it has: lockstep never stalls the group."""
    sharding: Sharding = "none"
    """none (every rank holds the whole model and optimizer state; gradients all-reduced) or
    fsdp (FSDP2 `fully_shard`: parameters, gradients and optimizer state sharded across the
    drafter ranks, for drafters whose optimizer state does not fit one GPU). The same step,
    the same checkpoints, either way (drafter/sharding.py)."""
    compile: Compile = "off"
    """The drafter's forward as one torch.compile graph, with this torch.compile mode, on CUDA
    (drafter/compiled_forward.py): off (default: only the element-wise parts, attention and CE
    chunks are compiled), default, max-autotune-no-cudagraphs, or reduce-overhead (CUDA graphs,
    each step padded to the job's largest so far: one graph once the longest has run;
    drafter/step_shape.py). sharding none only; with fp8 the float8 layers are traced into the
    graph instead of compiled one by one."""
    lm_head_chunk_gib: float = 0.0
    """Memory of one chunk of the chunked LM head + CE (its [rows, vocab] logits and their
    gradient, 4 bytes an entry); rows per chunk follow from it and the vocabulary. 0: 1/20 of
    the GPU's memory (about 7 GiB of a 139 GiB H200), 1 GiB on CPU."""
    init_from: str | None = None
    """An exported drafter (config.json + model.safetensors, a directory or a Hub id) whose
    weights a fresh job starts from (drafter/warm_start.py); the optimizer starts fresh. A
    resumed job ignores it: the checkpoint wins."""

    def check(self) -> None:
        _require(1 <= self.num_workers <= 1024, "drafter.num_workers", "must be in [1, 1024]")
        _require(self.lm_head_chunk_gib == 0 or 1 / 1024 <= self.lm_head_chunk_gib <= 1024,
                 "drafter.lm_head_chunk_gib", f"must be 0 (auto) or in [1/1024, 1024], got {self.lm_head_chunk_gib}")
        _require(self.compile == "off" or self.sharding == "none", "drafter.compile",
                 f"{self.compile} needs drafter.sharding=none (not measured under FSDP), got {self.sharding}")
        _require(0 <= self.max_group_wait_s <= 3600, "drafter.max_group_wait_s", "must be in [0, 3600]")
        _require(self.precision != "fp8" or self.fp8_layers or not self.fp8_shared_casts, "drafter.fp8_shared_casts",
                 "casts the inputs of float8 layers: it needs drafter.fp8_layers true")
        _require(self.precision != "fp8" or self.fp8_layers or self.fp8_lm_head != "none", "drafter.fp8_layers",
                 "false with drafter.fp8_lm_head none leaves nothing in float8: use drafter.precision bf16")
        delayed = self.precision == "fp8" and self.fp8_recipe == "delayed"
        _require(not delayed or self.compile == "off", "drafter.fp8_recipe",
                 f"delayed runs its float8 layers outside torch.compile: it needs drafter.compile off, got {self.compile}")
        _require(not delayed or self.sharding == "none", "drafter.fp8_recipe",
                 f"delayed keeps each layer's float8 weight for the step: it needs drafter.sharding none "
                 f"(not measured under FSDP), got {self.sharding}")
        _require(not delayed or not self.fp8_shared_casts, "drafter.fp8_shared_casts",
                 "concatenates torchao's float8 layers: it needs drafter.fp8_recipe tensorwise or rowwise, got delayed")
        _check_devices("drafter.devices", self.devices, self.num_workers)
        _require(1 <= self.fifo_sequences <= 1 << 20, "drafter.fifo_sequences", "must be in [1, 1048576]")
        _require(1 <= self.prefetch <= 1024, "drafter.prefetch", "must be in [1, 1024]")
        _require(self.init_from is None or self.init_from.strip() != "", "drafter.init_from",
                 "must name an exported drafter directory or a Hub id (or be null), got ''")
        _require(self.precision != "fp8" or self.dtype == "bfloat16", "drafter.precision",
                 f"fp8 needs drafter.dtype=bfloat16 (the compute dtype around the float8 matmuls), "
                 f"got {self.dtype}")

    def device_of(self, rank: int) -> str:
        """The device of global rank `rank`: devices are per node, ranks count across nodes."""
        return self.devices[rank % self.num_workers if len(self.devices) > 1 else 0]


def normalized_layer_types(value: list[str] | str | None, num_layers: int) -> list[str]:
    """model.layer_types as a list of ``num_layers`` names (see ModelConfig.layer_types)."""
    key = "model.layer_types"
    if value is None:
        return ["full_attention"] * num_layers
    if isinstance(value, str):
        bad = sorted(set(value) - set(LAYER_TYPE_LETTERS))
        _require(not bad, key, f"{value!r}: the compact form is one letter per layer, "
                 f"{' or '.join(f'{k} ({v})' for k, v in LAYER_TYPE_LETTERS.items())}; found {bad}")
        value = [LAYER_TYPE_LETTERS[c] for c in value]
    _require(isinstance(value, list) and all(t in LAYER_TYPES for t in value), key,
             f"{value!r}: each entry must be one of {', '.join(LAYER_TYPES)}")
    _require(len(value) == num_layers, key, f"{len(value)} entries for model.num_layers={num_layers}")
    return list(value)


@dataclass(kw_only=True, slots=True)
class ModelConfig(_Section):
    NAME = "model"
    num_layers: int = 5
    """Drafter decoder layers."""
    target_layer_ids: list[int] | None = None
    """Target layers whose outputs are captured; default: the paper's spacing."""
    block_size: int = 16
    """Tokens drafted per block (anchor token + block_size-1 masks)."""
    mask_token_id: int | None = None
    """Id of the mask token; default: the target tokenizer's mask token."""
    layer_types: list[str] | str | None = None
    """Attention of each drafter layer: a list of full_attention / sliding_attention, one per
    layer, or one letter per layer (F full, S sliding: "SSSSF" is 4 sliding + 1 full); null:
    all full_attention. Read back as the list form."""
    sliding_window: int | None = None
    """Window of the sliding_attention layers, in tokens: a block query at position i sees a
    key (context or block) at position j only if i - j < sliding_window (HF's rule); needed
    when a layer slides, refused otherwise."""

    def check(self) -> None:
        _require(1 <= self.num_layers <= 256, "model.num_layers", "must be in [1, 256]")
        self.layer_types = normalized_layer_types(self.layer_types, self.num_layers)
        slides = "sliding_attention" in self.layer_types
        if slides:
            _require(isinstance(self.sliding_window, int) and not isinstance(self.sliding_window, bool)
                     and 1 <= self.sliding_window <= MAX_TOKENS, "model.sliding_window",
                     f"a sliding_attention layer needs a window in [1, {MAX_TOKENS}], got {self.sliding_window!r}")
        else:
            _require(self.sliding_window is None, "model.sliding_window",
                     f"{self.sliding_window!r} given but no layer of model.layer_types is sliding_attention")
        _require(2 <= self.block_size <= MAX_BLOCK_SIZE, "model.block_size", f"must be in [2, {MAX_BLOCK_SIZE}]")
        if self.target_layer_ids is not None:
            _require(len(self.target_layer_ids) >= 1 and min(self.target_layer_ids) >= 0,
                     "model.target_layer_ids", "need non-negative layer indices")
            _require(len(set(self.target_layer_ids)) == len(self.target_layer_ids),
                     "model.target_layer_ids", f"a layer is named twice: {self.target_layer_ids}")
        if self.mask_token_id is not None:
            _require(self.mask_token_id >= 0, "model.mask_token_id", "must be >= 0")


@dataclass(kw_only=True, slots=True)
class OptimizerConfig(_Section):
    NAME = "optimizer"
    name: OptimizerName = "muon"
    """adamw (every parameter) or muon (torch.optim.Muon for every matrix: the layers'
    projections and fc; AdamW for the norms: drafter/optimizers.py)."""
    lr: float = 6e-4
    """Peak learning rate (AdamW's; Muon's too, scaled per matrix by muon_adjust_lr)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    muon_lr: float | None = None
    """muon only: peak learning rate of the Muon matrices; null: optimizer.lr."""
    muon_momentum: float = 0.95
    """muon only: momentum of the Muon matrices (Nesterov)."""
    muon_adjust_lr: MuonAdjustLr = "match_rms_adamw"
    """muon only: torch's per-matrix lr scaling: match_rms_adamw (0.2 * sqrt(max(A, B)), so
    optimizer.lr is the AdamW-tuned rate) or original (sqrt(max(1, A/B)), Keller Jordan's)."""
    muon_weight_decay: float = 0.0
    """muon only: decoupled weight decay of the Muon matrices."""

    def check(self) -> None:
        _require(0 < self.lr <= 1.0, "optimizer.lr", f"must be in (0, 1], got {self.lr}")
        _require(self.muon_lr is None or (isinstance(self.muon_lr, (int, float)) and math.isfinite(self.muon_lr)
                                          and 0 < self.muon_lr <= 1.0), "optimizer.muon_lr",
                 f"must be null or in (0, 1], got {self.muon_lr!r}")
        _require(0 <= self.muon_momentum < 1, "optimizer.muon_momentum", "must be in [0, 1)")
        _require(0 <= self.muon_weight_decay <= 1.0, "optimizer.muon_weight_decay", "must be in [0, 1]")
        _require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optimizer.beta1/beta2", "must be in [0, 1)")
        _require(0 <= self.weight_decay <= 1.0, "optimizer.weight_decay", "must be in [0, 1]")
        _require(self.grad_clip > 0, "optimizer.grad_clip", "must be > 0")


@dataclass(kw_only=True, slots=True)
class ScheduleConfig(_Section):
    NAME = "schedule"
    name: ScheduleName = "wsd"
    """cosine (warmup, then cosine to the end) or wsd (warmup, stable at the peak, then a
    decay over the last decay_ratio of the planned steps): drafter/schedule.py."""
    warmup_ratio: float = 0.04
    """Fraction of the planned steps of linear warmup."""
    min_lr_ratio: float = 0.0
    """The schedule ends at optimizer.lr * min_lr_ratio."""
    decay_ratio: float = 0.2
    """wsd only: fraction of the planned steps of the final decay."""
    decay_shape: DecayShape = "cosine"
    """wsd only: the decay's curve from 1 to min_lr_ratio: linear, cosine, or sqrt
    (1 - sqrt(progress), the "1-sqrt" cooldown)."""

    def check(self) -> None:
        _require(0.0 <= self.warmup_ratio < 1.0, "schedule.warmup_ratio", "must be in [0, 1)")
        _require(0.0 <= self.min_lr_ratio <= 1.0, "schedule.min_lr_ratio", "must be in [0, 1]")
        _require(0.0 < self.decay_ratio <= 1.0, "schedule.decay_ratio", "must be in (0, 1]")
        _require(self.name != "wsd" or self.warmup_ratio + self.decay_ratio <= 1.0, "schedule.decay_ratio",
                 f"warmup_ratio + decay_ratio = {self.warmup_ratio + self.decay_ratio:g} exceeds 1 "
                 f"(the planned steps)")


@dataclass(kw_only=True, slots=True)
class ObjectiveConfig(_Section):
    NAME = "objective"
    max_anchors_per_seq: int = 512
    """Most anchors sampled in one sequence."""
    anchors_per_step: int = 2048
    """Anchors (blocks) per optimizer step on each drafter; fixes the step's cost."""
    weighting: Weighting = "dpace"
    """Loss weight of block position k: decay (exp(-(k-1)/gamma), the DFlash paper's) or dpace
    (D-PACE: weights from the drafter's own per-slot confidence each step, the gradient of a
    surrogate of the expected acceptance length: drafter/objective.py)."""
    gamma: float = 7.0
    """decay only: loss weight of block position k is exp(-(k-1)/gamma)."""
    dpace_alpha: float = 0.5
    """dpace only: smoothing of the confidence, q~ = (1 - alpha) q + alpha, in (0, 1]."""

    def check(self) -> None:
        _require(0 < self.dpace_alpha <= 1, "objective.dpace_alpha", f"must be in (0, 1], got {self.dpace_alpha}")
        _require(1 <= self.max_anchors_per_seq <= MAX_TOKENS, "objective.max_anchors_per_seq",
                 f"must be in [1, {MAX_TOKENS}]")
        _require(1 <= self.anchors_per_step <= 1 << 20, "objective.anchors_per_step", "must be in [1, 1048576]")
        _require(self.gamma > 0, "objective.gamma", "must be > 0")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig(_Section):
    NAME = "checkpoint"
    every_steps: int = 200
    """Steps between checkpoints (drafter rank 0 writes); one is always written at the end."""
    keep_last: int | None = None
    """Committed checkpoints kept, the newest ones; 0 or null keeps all. The one a resume needs
    (the last commit, latest.json's) and the best by validation are never deleted."""

    def check(self) -> None:
        _require(self.every_steps >= 1, "checkpoint.every_steps", "must be >= 1")
        _require(self.keep_last is None or (isinstance(self.keep_last, int) and 0 <= self.keep_last <= 1 << 20),
                 "checkpoint.keep_last", f"must be null or in [0, 1048576] (0: keep all), got {self.keep_last!r}")


@dataclass(kw_only=True, slots=True)
class ValidationConfig(_Section):
    NAME = "validation"
    every_steps: int | None = None
    """Steps between validations (null: none): the drafter's expected acceptance length on the
    step's blocks, scored before it trains on them (drafter/acceptance_proxy.py); logged, sent
    to the trackers, and the best checkpoint by it is kept (checkpoint.keep_last)."""
    prompts: int = 0
    """Held-out prompts decoded at each validated checkpoint (0: the proxy alone): drafter rank 0
    loads the target on its device and decodes the dataset's first `prompts` held-out prompts
    speculatively (greedy), so tau on prompts never trained on is logged and sent to the
    trackers, and the best checkpoint is the best by it (eval/held_out_validation.py)."""
    max_new_tokens: int = 64
    """prompts > 0: new tokens per held-out prompt."""

    def check(self) -> None:
        _require(self.every_steps is None or (isinstance(self.every_steps, int) and self.every_steps >= 1),
                 "validation.every_steps", f"must be null or >= 1, got {self.every_steps!r}")
        _require(0 <= self.prompts <= 4096, "validation.prompts", f"must be in [0, 4096], got {self.prompts}")
        _require(self.prompts == 0 or self.every_steps is not None, "validation.prompts",
                 f"{self.prompts} held-out prompts need validation.every_steps (when to decode them)")
        _require(1 <= self.max_new_tokens <= 4096, "validation.max_new_tokens",
                 f"must be in [1, 4096], got {self.max_new_tokens}")


@dataclass(kw_only=True, slots=True)
class DispatchConfig(_Section):
    NAME = "dispatch"
    address: str = ""
    """ZMQ address of the dispatcher; empty: ipc:// socket in the run directory."""
    status_interval_s: float = 5.0
    """Seconds between status lines of the supervisor."""
    heartbeat_interval_s: float = 1.0
    """Seconds between heartbeats, both ways."""
    heartbeat_timeout_s: float = 30.0
    """A worker silent this long is declared dead (hung) and its work requeued."""
    auth: Auth = "auto"
    """Who may connect on tcp://: curve (ZMQ CURVE with the job's keys in <run_dir>/keys),
    none, or auto: curve unless the address is loopback. ipc:// relies on the run
    directory's permissions (0700)."""
    max_batch_losses: int = 20
    """A batch the drafters report lost this many times (its target's hidden states could not
    be copied: a dead target loses each of its batches once) stops the dispatcher with an
    error naming it and the last reason, instead of requeueing it for ever."""

    def check(self) -> None:
        if self.address:
            check_address(self.address, "dispatch.address")  # one ZMQ could never bind is a config error
        _require(0 < self.status_interval_s <= 3600, "dispatch.status_interval_s", "must be in (0, 3600]")
        _require(0 < self.heartbeat_interval_s <= 600, "dispatch.heartbeat_interval_s", "must be in (0, 600]")
        _require(2 * self.heartbeat_interval_s < self.heartbeat_timeout_s <= 86400,
                 "dispatch.heartbeat_timeout_s", "must exceed 2 x heartbeat_interval_s and be <= 86400")
        _require(1 <= self.max_batch_losses <= 1_000_000, "dispatch.max_batch_losses", "must be in [1, 1000000]")


@dataclass(kw_only=True, slots=True)
class SuperviseConfig(_Section):
    NAME = "supervise"
    startup_timeout_s: float = 300.0
    """Each worker must register with the dispatcher within this time."""
    grace_s: float = 10.0
    """SIGTERM -> wait this long -> SIGKILL."""
    max_restarts: int = 3
    """Restarts allowed per window, per target rank, for the drafter group and for the
    dispatcher, before the job fails (0: any death fails the job)."""
    restart_window_s: float = 600.0
    """Window of the restart count."""
    drafter_stall_s: float = 30.0
    """A drafter whose liveness beacon (rewritten every 0.5 s by a thread) is older than this
    is stopped or frozen (SIGSTOP, a lock held with the GIL): its group restarts."""
    drafter_step_timeout_s: float = 600.0
    """A drafter longer than this in one optimizer step (after the first) hangs."""
    drafter_compile_timeout_s: float = 1800.0
    """The first step, which compiles kernels, may take this long."""
    drafter_checkpoint_timeout_s: float = 1800.0
    """A checkpoint (write, commit) may take this long."""
    stop_timeout_s: float = 120.0
    """On SIGINT/SIGTERM the drafters get this long to checkpoint and commit before
    everything is stopped."""

    def check(self) -> None:
        day = 86400.0
        _require(0 < self.startup_timeout_s <= day, "supervise.startup_timeout_s", "must be in (0, 86400]")
        _require(0 <= self.grace_s <= 3600, "supervise.grace_s", "must be in [0, 3600]")
        _require(0 <= self.max_restarts <= 1000, "supervise.max_restarts", "must be in [0, 1000]")
        _require(0 < self.restart_window_s <= 30 * day, "supervise.restart_window_s", "must be in (0, 30 days]")
        for name in ("drafter_stall_s", "drafter_step_timeout_s", "drafter_compile_timeout_s",
                     "drafter_checkpoint_timeout_s"):
            _require(1 <= getattr(self, name) <= day, f"supervise.{name}", "must be in [1, 86400]")
        _require(0 <= self.stop_timeout_s <= day, "supervise.stop_timeout_s", "must be in [0, 86400]")

    def drafter_phase_limits(self) -> dict[str, float]:
        """Longest time a drafter may stay in each beacon phase (others: no limit)."""
        return {"compile": self.drafter_compile_timeout_s, "step": self.drafter_step_timeout_s,
                "checkpoint": self.drafter_checkpoint_timeout_s}


@dataclass(kw_only=True, slots=True)
class MetricsConfig(_Section):
    NAME = "metrics"
    sinks: list[MetricSink] = field(default_factory=lambda: ["tensorboard"])
    """Trackers the supervisor writes the job's scalars to, once per status poll: tensorboard
    (RUN_DIR/tensorboard), wandb (Weights & Biases, `pip install 'dflash-ipc[wandb]'`); [] for none."""
    wandb_project: str = "dflash-ipc"
    """W&B project of the run."""
    wandb_entity: str = ""
    """W&B entity (team or user); empty: the account's default entity."""
    wandb_run_name: str = ""
    """W&B display name of the run; empty: the run directory's name."""
    wandb_tags: list[str] = field(default_factory=list)
    """W&B tags of the run."""
    wandb_mode: WandbMode | None = None
    """online, offline (written under RUN_DIR/wandb, uploaded later by `wandb sync`) or
    disabled; null: WANDB_MODE of the environment, else online."""

    def check(self) -> None:
        for sink in self.sinks:
            _require(sink in METRIC_SINKS, "metrics.sinks", f"{sink!r} not allowed; allowed: {', '.join(METRIC_SINKS)}")
        _require(len(set(self.sinks)) == len(self.sinks), "metrics.sinks", f"a sink is named twice: {self.sinks}")
        _require(self.wandb_mode is None or self.wandb_mode in WANDB_MODES, "metrics.wandb_mode",
                 f"{self.wandb_mode!r} not allowed; allowed: {', '.join(WANDB_MODES)} or null")
        for key, name in (("metrics.wandb_project", self.wandb_project), ("metrics.wandb_entity", self.wandb_entity)):
            _require(not any(c in name for c in WANDB_NAME_FORBIDDEN) and len(name) <= 128, key,
                     f"{name!r}: at most 128 characters, none of {WANDB_NAME_FORBIDDEN}")
        _require(self.wandb_project.strip() != "", "metrics.wandb_project", "must name a project, got ''")
        for tag in self.wandb_tags:
            _require(isinstance(tag, str) and 0 < len(tag) <= WANDB_MAX_TAG, "metrics.wandb_tags",
                     f"{tag!r}: tags are 1 to {WANDB_MAX_TAG} characters")


@dataclass(kw_only=True, slots=True)
class JobConfig:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    supervise: SuperviseConfig = field(default_factory=SuperviseConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    builtin: BuiltinConfig = field(default_factory=BuiltinConfig)

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Checks that span sections."""
        uses_cuda = any(d.startswith("cuda") for d in self.target.devices + self.drafter.devices)
        _require(not (uses_cuda and any(d == "cpu" for d in self.target.devices + self.drafter.devices)),
                 "target.devices/drafter.devices",
                 "mixing cpu and cuda workers is not supported (hidden states move by CUDA IPC "
                 "between GPUs, by shared memory between CPU processes)")
        if self.drafter.sharding == "fsdp" and uses_cuda and self.drafter.num_workers > 1:
            _require(len(set(self.drafter.devices)) == self.drafter.num_workers, "drafter.sharding",
                     f"fsdp needs one GPU per drafter (drafter.devices={self.drafter.devices} for "
                     f"{self.drafter.num_workers} drafters); use drafter.sharding: none when drafters share GPUs")
        _require(not (self.objective.weighting == "dpace" and self.drafter.precision == "fp8"
                      and self.drafter.fp8_lm_head in ("all", "grad")), "objective.weighting",
                 "dpace computes per-row CE in the LM head's own dtype: with drafter.precision=fp8 set "
                 f"drafter.fp8_lm_head to none or auto (got {self.drafter.fp8_lm_head}), or objective.weighting=decay")
        _require(not (self.drafter.precision == "fp8" and not self.drafter.fp8_layers
                      and self.drafter.fp8_lm_head == "auto" and self.objective.weighting == "dpace"),
                 "drafter.fp8_layers", "false leaves nothing in float8 under objective.weighting=dpace (its "
                 "fp8_lm_head auto is none): use drafter.precision bf16, or objective.weighting=decay")
        # Muon orthogonalises whole matrices; under FSDP each rank holds a shard of each.
        _require(not (self.optimizer.name == "muon" and self.drafter.sharding == "fsdp"), "optimizer.name",
                 "muon needs whole matrices on every rank: use drafter.sharding: none with it, or optimizer.name: adamw")
        every = self.validation.every_steps
        if every is not None:
            # The best checkpoint is chosen among validated steps that have a checkpoint: with
            # checkpoints on a multiple of the validation period, every checkpoint is a candidate.
            _require(self.checkpoint.every_steps % every == 0, "validation.every_steps",
                     f"{every} must divide checkpoint.every_steps={self.checkpoint.every_steps} (each checkpoint "
                     f"is then validated and can be kept as the best), e.g. validation.every_steps="
                     f"{math.gcd(every, self.checkpoint.every_steps)}")
        if self.run.num_nodes > 1:
            _require(self.dispatch.address.startswith("tcp://"), "dispatch.address",
                     f"run.num_nodes={self.run.num_nodes}: the dispatcher must listen on tcp://HOST:PORT "
                     f"reachable from every node (dflash-up --dispatcher), got '{self.dispatch.address}'")

    @property
    def files(self) -> RunFiles:
        """The paths of this job's run directory, as this node sees them."""
        return RunFiles(self.run.run_dir, self.run.node_rank, self.run.num_nodes)

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
        return self.dispatch.address or f"ipc://{self.files.socket}"


def config_to_dict(cfg: object) -> dict:
    return dataclasses.asdict(cfg)

