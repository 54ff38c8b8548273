"""``dflash-ipc bench pipeline``: how close the whole pipeline comes to its slowest stage.

Three phases of one job config, run one after the other (they never share a GPU):

1. **target capacity**: one target worker's real forward path alone, on
   ``target.devices[0]``: the job's epoch plan (``plan_job``) cycled, each batch's token ids
   read from the dataset memmap as the worker reads them (``TargetWorker.batch_tokens``) and
   run through ``FeatureCapture.forward_into`` into a tensor shaped like one slot. Valid
   (unpadded) tokens per second.
2. **drafter capacity**: the real ``DrafterTrainer`` on ``drafter.devices[0]``, world size 1,
   stepped through ``DrafterTrainer.step`` (the sequence queue counts the tokens: the
   sequences each step consumed). Sequences come from the same plan in the same order, with their real
   token ids and loss masks; their features are slices of one random tensor of the right
   width and dtype (no slot copy). Trained tokens per second.
3. **end to end**: the real job (``Supervisor(cfg).run()``: dispatcher, targets, drafters as
   processes) in a fresh run directory with the config's worker counts. Its window starts
   ``warmup_s`` after the first drafter step ends (process start, model loading and the
   first compilation are not steady state) and lasts ``seconds``; the bench then stops the
   job (``request_stop``). ``tok_rate`` = tokens of the drafter steps ending inside the
   window (drafter timelines under ``<run_dir>/metrics/``, summed over drafters) / window
   length. A job whose data ends first is measured up to its last step (``finished_early``).

Capacities are per GPU (one worker alone). The pipeline's capacity is
``min(target capacity x target GPUs, drafter capacity x drafter GPUs)`` (GPUs: distinct
devices of each side; 1 and 1 for 1 target + 1 drafter, and for any config whose workers share
one GPU per side), and ``ratio = tok_rate / pipeline capacity``: 1.0 means the pipeline
loses nothing to transport, dispatch, or stalls. In each capacity phase the first batch or
step (compilation), then ``warmup_s`` (and at least 2 batches / 3 steps in all) run before
the measured ``seconds``; the clock is read after a device synchronisation at both ends. On
CPU each capacity is measured with the intra-op threads its worker gets in the job (cores /
CPU workers, divided again by the drafter count for a drafter).

    dflash-ipc bench pipeline --config configs/2xh200.yaml -o target.num_workers=1 \\
        -o drafter.num_workers=1 --seconds 60 --warmup-s 30 --json bench.json
"""

from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import logging
import os
import threading
import time

import torch

from dflash_ipc.config.schema import JobConfig
from dflash_ipc.errors import ConfigError, DataError, DFlashError
from dflash_ipc.config.dtypes import TORCH_DTYPES
from dflash_ipc.obs.timelines import load_timelines
from dflash_ipc.run.files import RunFiles

log = logging.getLogger(__name__)

TARGET_MIN_WARMUP = 2      # batches before the clock starts, whatever warmup_s says
DRAFTER_MIN_WARMUP = 3     # steps: the first compiles, the next may recompile for new shapes
WATCH_POLL_S = 0.5         # how often the end-to-end watcher reads the drafter timelines
STARTUP_SLACK_S = 120.0    # beyond supervise.startup_timeout_s, wait this long for a first step
GOAL = 0.95


class BenchError(DFlashError):
    """The benchmark could not measure what it was asked to (the message says why)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prepare_device(device: str, key: str) -> torch.device:
    from dflash_ipc.config.machine import require_device
    require_device(device, key)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def _release(device: torch.device) -> None:
    """Frees what a phase left on its GPU, so the next phase (and the job's processes) get it."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def worker_threads(cfg: JobConfig, role: str) -> int | None:
    """Intra-op threads a CPU worker of ``role`` gets in the job (None on a GPU): the
    supervisor's ``OMP_NUM_THREADS`` (cores / CPU workers unless set), which a drafter divides
    again by the drafter count. Capacities on CPU are measured with that many threads."""
    side = cfg.target if role == "target" else cfg.drafter
    if side.device_of(0) != "cpu":
        return None
    cpu_workers = sum(d == "cpu" for d in [d for r in range(cfg.target.num_workers) for d in cfg.target.devices_of(r)]
                      + [cfg.drafter.device_of(r) for r in range(cfg.drafter.num_workers)])
    env = os.environ.get("OMP_NUM_THREADS", "")
    threads = int(env) if env.isdigit() and int(env) > 0 else max(1, (os.cpu_count() or 1) // cpu_workers)
    return max(1, threads // cfg.drafter.num_workers) if role == "drafter" else threads


@contextlib.contextmanager
def _threads(count: int | None):
    if count is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def timed_loop(run_one, device: torch.device, *, seconds: float, warmup_s: float, min_warmup: int) -> dict:
    """Calls ``run_one()`` (returns the tokens it did) through a warmup, then for ``seconds``.

    Warmup: the first call (it may compile), then more calls until ``warmup_s`` passed since
    it ended and ``min_warmup`` calls were made in all, as the end-to-end window starts
    ``warmup_s`` after the first drafter step. Measured: at least one call, until ``seconds``
    passed; the device is synchronised before the clock starts and before it stops, so
    queued work is counted where it ran.
    """
    started = time.perf_counter()
    run_one()
    first_done = time.perf_counter()
    warm_calls = 1
    while warm_calls < min_warmup or time.perf_counter() - first_done < warmup_s:
        run_one()
        warm_calls += 1
    _sync(device)
    t0 = time.perf_counter()
    warm_s = t0 - started
    calls = tokens = 0
    while calls < 1 or time.perf_counter() - t0 < seconds:
        tokens += run_one()
        calls += 1
    _sync(device)
    elapsed = time.perf_counter() - t0
    return {"tokens": tokens, "calls": calls, "seconds": elapsed, "tok_per_s": tokens / elapsed,
            "warmup_calls": warm_calls, "warmup_s": warm_s}


def _plan(cfg: JobConfig, dataset) -> list:
    from dflash_ipc.dispatch.proc import plan_job
    batches = [b for epoch in plan_job(cfg, dataset.lengths) for b in epoch]
    if not batches:
        raise DataError(f"{cfg.data.path}: the epoch plan holds no batch; nothing to benchmark")
    return batches


# --- phase 1: target capacity --------------------------------------------------------------


def target_capacity(cfg: JobConfig, *, seconds: float, warmup_s: float) -> dict:
    """Valid tokens/s of one target worker's forward path on ``target.devices[0]`` (with
    target.gpus_per_worker K > 1: of one K-process worker on ``target.devices[0:K]``, this process
    its leader and the followers real processes, bench/followers.py)."""
    from dflash_ipc.bench.followers import worker_followers

    with worker_followers(cfg) as group:
        return _target_capacity(cfg, group, seconds=seconds, warmup_s=warmup_s)


def _target_capacity(cfg: JobConfig, group, *, seconds: float, warmup_s: float) -> dict:
    from dflash_ipc.data.dataset import TokenDataset
    from dflash_ipc.target.fit import probe_target_batch
    from dflash_ipc.target.worker import TargetWorker, load_capture
    from dflash_ipc.transport.slots import SlotLayout

    device = cfg.target.device_of(0)
    dev = _prepare_device(device, "target.devices")
    capture = load_capture(cfg, device)
    dataset = TokenDataset(cfg.data.path)
    if group is not None:  # the followers run the start-up probe first, as with a real leader
        probe_target_batch(capture, None, cfg.data, device, longest=int(dataset.lengths.max()))
    batches = _plan(cfg, dataset)
    # What the phase holds on its device, dropped (and the memory freed) when it ends.
    held = {"worker": TargetWorker(capture, dataset, pool=None),  # batch_tokens: the memmap read + copy
            "capture": capture,
            "slot": torch.empty(SlotLayout.required_max_tokens(cfg.data.token_budget), capture.feature_dim,
                                dtype=capture.dtype, device=dev)}  # [max tokens, F], one slot's shape
    del capture
    cycle = itertools.cycle(batches)

    def one_batch() -> int:
        batch = next(cycle)
        if group is not None:
            group.announce(list(batch.sample_ids), batch.padded_len)
        input_ids, lengths = held["worker"].batch_tokens(list(batch.sample_ids), batch.padded_len)
        return held["capture"].forward_into(input_ids, lengths, held["slot"])

    log.info("target capacity: %s on %s, %d planned batches, %g s warmup + %g s", cfg.target.path,
             ",".join(cfg.target.devices_of(0)), len(batches), warmup_s, seconds)
    threads = worker_threads(cfg, "target")
    try:
        with _threads(threads):
            figures = timed_loop(one_batch, dev, seconds=seconds, warmup_s=warmup_s, min_warmup=TARGET_MIN_WARMUP)
    finally:
        held.clear()
        _release(dev)
    figures.update(device=device, batches=figures.pop("calls"), warmup_batches=figures.pop("warmup_calls"),
                   cpu_threads=threads, devices=cfg.target.devices_of(0), gpus_per_worker=cfg.target.gpus_per_worker)
    log.info("target capacity: %.0f tok/s (%d batches in %.1f s)", figures["tok_per_s"],
             figures["batches"], figures["seconds"])
    return figures


# --- phase 2: drafter capacity -------------------------------------------------------------


def drafter_capacity(cfg: JobConfig, *, seconds: float, warmup_s: float) -> dict:
    """Trained tokens/s of the real trainer, world size 1, on ``drafter.devices[0]``."""
    from dflash_ipc.data.dataset import TokenDataset
    from dflash_ipc.drafter.model import DFlashConfig
    from dflash_ipc.hf.target_head import FrozenTargetHead
    from dflash_ipc.drafter.sequence_queue import SequenceQueue
    from dflash_ipc.drafter.trainer import DrafterTrainer, eligible_anchor_count, estimate_total_steps
    from dflash_ipc.hf.target_config import load_target_config

    device = cfg.drafter.device_of(0)
    dev = _prepare_device(device, "drafter.devices")
    dataset = TokenDataset(cfg.data.path)
    batches = _plan(cfg, dataset)
    anchors = [eligible_anchor_count(dataset.sample(i)[1], cfg.objective.max_anchors_per_seq)
               for i in range(len(dataset))]
    if not any(anchors):
        raise DataError(f"{cfg.data.path}: no sample has an anchor (loss at two consecutive positions); "
                        "the drafter cannot train on it")
    model_config = DFlashConfig.from_target_config(
        load_target_config(cfg.target.path), num_draft_layers=cfg.model.num_layers, block_size=cfg.model.block_size,
        mask_token_id=cfg.model.mask_token_id, target_layer_ids=cfg.model.target_layer_ids,
        layer_types=cfg.model.layer_types, sliding_window=cfg.model.sliding_window)
    head = FrozenTargetHead.from_pretrained(cfg.target.path, dtype=TORCH_DTYPES[cfg.drafter.dtype], device=device)
    total = estimate_total_steps(dataset, cfg.objective, num_epochs=cfg.data.num_epochs, world_size=1)
    trainer = DrafterTrainer(cfg, model_config, head, device=device, total_steps=total)
    backend = trainer.backend
    width = model_config.num_context_features * model_config.hidden_size
    gen = torch.Generator(device=dev).manual_seed(cfg.run.seed)
    # What the phase holds on its device, dropped (and the memory freed) when it ends. Every
    # batch's features are a slice of one random [token budget, F] tensor, in the slot's dtype.
    budget = cfg.objective.anchors_per_step
    held = {"trainer": trainer,
            "queue": SequenceQueue(dataset, max_anchors_per_seq=cfg.objective.max_anchors_per_seq),
            "features": torch.randn(cfg.data.token_budget, width, generator=gen, device=dev,
                                    dtype=TORCH_DTYPES[cfg.target.dtype])}
    del trainer, head
    cycle = itertools.cycle(batches)
    batch_ids = itertools.count()  # unique per pass over the plan, as copies are

    def fill() -> None:
        """Queues planned batches, in plan order, until a step's anchors wait (as a copy does)."""
        queue = held["queue"]
        while queue.anchors < budget:
            batch = next(cycle)
            queue.add_copy(next(batch_ids), 1, batch.epoch, list(batch.sample_ids),
                           held["features"][:batch.num_tokens])

    steps_s: list[float] = []

    def one_step() -> int:
        fill()
        queue = held["queue"]
        before = queue.trained_tokens
        chosen = queue.take(budget)
        stats = held["trainer"].step(chosen)
        queue.record_trained(chosen)
        queue.take_trained()  # nothing commits here
        steps_s.append(stats["step_s"])
        return queue.trained_tokens - before

    log.info("drafter capacity: %d layers on %s, %s attention, %d anchors/step, %g s warmup + %g s",
             cfg.model.num_layers, device, backend, budget, warmup_s, seconds)
    threads = worker_threads(cfg, "drafter")
    try:
        with _threads(threads):
            figures = timed_loop(one_step, dev, seconds=seconds, warmup_s=warmup_s, min_warmup=DRAFTER_MIN_WARMUP)
    finally:
        held.clear()
        _release(dev)
    measured = steps_s[figures["warmup_calls"]:]
    figures.update(device=device, steps=figures.pop("calls"), warmup_steps=figures.pop("warmup_calls"),
                   step_s_mean=sum(measured) / len(measured), anchors_per_step=budget,
                   cpu_threads=threads, attention=backend)
    log.info("drafter capacity: %.0f tok/s (%d steps in %.1f s)", figures["tok_per_s"], figures["steps"],
             figures["seconds"])
    return figures


# --- phase 3: end to end -------------------------------------------------------------------


def _overlap(rows: list[dict], states: tuple[str, ...], start: float, end: float) -> float:
    return sum(max(0.0, min(r["t1"], end) - max(r["t0"], start)) for r in rows if r["state"] in states)


def window_rates(timelines: dict[str, list[dict]], start: float, end: float) -> dict:
    """Steady-state rates of a run over the wall-clock window ``(start, end]``.

    ``tok_rate``: tokens of drafter ``step`` intervals whose end falls in the window, summed
    over drafters, / window length; ``tgt_rate`` the same for target ``busy`` intervals
    (produced tokens). Busy fractions: the share of the window each side spent working,
    averaged over its workers.
    """
    length = end - start
    if length <= 0:
        raise BenchError(f"empty measurement window ({start:.3f}, {end:.3f}]")
    out = {"window_s": length, "tokens": 0, "steps": 0, "target_tokens": 0, "per_drafter": {}}
    busy = {"target": [], "drafter": []}
    for role, rows in timelines.items():
        kind = role.partition("/")[0]
        if kind not in busy:
            continue
        state = "step" if kind == "drafter" else "busy"
        done = [r for r in rows if r["state"] == state and start < r["t1"] <= end]
        tokens = sum(int(r.get("tokens", 0)) for r in done)
        busy[kind].append(_overlap(rows, (state,), start, end) / length)
        if kind == "drafter":
            out["tokens"] += tokens
            out["steps"] += len(done)
            out["per_drafter"][role] = {"tokens": tokens, "steps": len(done), "tok_rate": tokens / length}
        else:
            out["target_tokens"] += tokens
    out["tok_rate"] = out["tokens"] / length
    out["tgt_rate"] = out["target_tokens"] / length
    out["target_busy_fraction"] = sum(busy["target"]) / len(busy["target"]) if busy["target"] else 0.0
    out["drafter_busy_fraction"] = sum(busy["drafter"]) / len(busy["drafter"]) if busy["drafter"] else 0.0
    return out


def _drafter_steps(run_dir: str) -> list[dict]:
    return [r for role, rows in load_timelines(run_dir).items() if role.startswith("drafter/")
            for r in rows if r["state"] == "step"]


def default_run_dir(cfg: JobConfig) -> str:
    """``<run.run_dir>-bench-<time>``: a sibling of the job's run directory, never inside it."""
    return f"{os.path.abspath(cfg.run.run_dir)}-bench-{time.strftime('%Y%m%d-%H%M%S')}"


def end_to_end(cfg: JobConfig, *, seconds: float, warmup_s: float, run_dir: str) -> dict:
    """Runs the job in ``run_dir`` (must be new or empty) and measures tok_rate over its window."""
    from dflash_ipc.supervise.supervisor import Supervisor

    run_dir = os.path.abspath(run_dir)
    if os.path.isdir(run_dir) and os.listdir(run_dir):
        raise ConfigError(f"bench pipeline: run directory {run_dir} is not empty; the end-to-end run "
                          "needs a fresh one (--run-dir)")
    cfg = copy.deepcopy(cfg)
    cfg.run.run_dir = run_dir
    sup = Supervisor(cfg)
    state: dict = {}
    done = threading.Event()

    def watch() -> None:
        """Finds the first drafter step, then stops the job at the end of the window."""
        give_up = time.time() + cfg.supervise.startup_timeout_s + STARTUP_SLACK_S
        while not done.wait(WATCH_POLL_S):
            if "first_step" not in state:
                steps = _drafter_steps(run_dir) if os.path.isdir(run_dir) else []
                if steps:
                    first = min(r["t1"] for r in steps)
                    state.update(first_step=first, window=(first + warmup_s, first + warmup_s + seconds))
                    log.info("end to end: first drafter step done; window of %g s from %g s after it",
                             seconds, warmup_s)
                elif time.time() > give_up:
                    state["no_step"] = True
                    sup.request_stop("bench: no drafter step", checkpoint=False)
                    return
                continue
            if time.time() >= state["window"][1]:
                state["stopped"] = True
                sup.request_stop("bench window", checkpoint=False)
                return

    watcher = threading.Thread(target=watch, name="bench-window", daemon=True)
    started = time.time()
    watcher.start()
    try:
        code = sup.run()
    finally:
        done.set()
        watcher.join()
    ended = time.time()
    logs = RunFiles(run_dir).logs
    if state.get("no_step"):
        raise BenchError(f"end to end: no drafter step within {ended - started:.0f} s; see {logs}")
    if code != 0:
        raise BenchError(f"end to end: the job stopped with exit code {code}; see {logs}")
    steps = _drafter_steps(run_dir)
    if not steps:
        raise BenchError(f"end to end: the job finished without a drafter step; see {run_dir}/metrics")
    first = state.get("first_step", min(r["t1"] for r in steps))
    start, end = first + warmup_s, first + warmup_s + seconds
    finished_early = not state.get("stopped")
    if finished_early:  # the data ended first: measure up to the last step
        end = min(end, max(r["t1"] for r in steps))
        if end <= start:
            raise BenchError(f"end to end: the job finished {end - first:.1f} s after its first drafter "
                             f"step, before the {warmup_s:g} s warmup was over; give it more data "
                             "(-o data.num_epochs=N) or a shorter --warmup-s")
        log.warning("end to end: the job finished before the window ended; measured %.1f s of %.1f s",
                    end - start, seconds)
    figures = window_rates(load_timelines(run_dir), start, end)
    figures.update(run_dir=run_dir, window=[start, end], finished_early=finished_early,
                   startup_s=first - started, total_s=ended - started,
                   targets=cfg.target.num_workers, drafters=cfg.drafter.num_workers)
    return figures


# --- the benchmark -------------------------------------------------------------------------


def gpus_of(devices: list[str], num_workers: int) -> int:
    """Distinct devices the workers of one side run on."""
    return len({devices[r if len(devices) > 1 else 0] for r in range(num_workers)})


def combine(target: dict, drafter: dict, e2e: dict, *, target_gpus: int = 1, drafter_gpus: int = 1) -> dict:
    """The headline figures from the three phases' results."""
    t_cap, d_cap = target["tok_per_s"], drafter["tok_per_s"]
    t_side, d_side = t_cap * target_gpus, d_cap * drafter_gpus
    capacity = min(t_side, d_side)
    bottleneck = "target" if t_side < d_side else "drafter" if d_side < t_side else "balanced"
    return {"target_capacity": t_cap, "drafter_capacity": d_cap, "tok_rate": e2e["tok_rate"],
            "target_gpus": target_gpus, "drafter_gpus": drafter_gpus, "pipeline_capacity": capacity,
            "ratio": e2e["tok_rate"] / capacity if capacity > 0 else 0.0, "bottleneck": bottleneck,
            "goal": GOAL}


def run_pipeline_bench(cfg: JobConfig, *, seconds: float = 60.0, warmup_s: float = 30.0,
                       run_dir: str | None = None) -> dict:
    """The three phases on a resolved config (``resolve_job``); returns every figure."""
    if seconds <= 0:
        raise ConfigError(f"bench pipeline: --seconds must be > 0, got {seconds:g}")
    if warmup_s < 0:
        raise ConfigError(f"bench pipeline: --warmup-s must be >= 0, got {warmup_s:g}")
    run_dir = run_dir or default_run_dir(cfg)
    target = target_capacity(cfg, seconds=seconds, warmup_s=warmup_s)
    drafter = drafter_capacity(cfg, seconds=seconds, warmup_s=warmup_s)
    e2e = end_to_end(cfg, seconds=seconds, warmup_s=warmup_s, run_dir=run_dir)
    leaders = [cfg.target.device_of(r) for r in range(cfg.target.num_workers)]  # one per worker of K GPUs
    figures = combine(target, drafter, e2e, target_gpus=gpus_of(leaders, cfg.target.num_workers),
                      drafter_gpus=gpus_of(cfg.drafter.devices, cfg.drafter.num_workers))
    figures.update(seconds=seconds, warmup_s=warmup_s, torch=torch.__version__,
                   target_gpus_per_worker=cfg.target.gpus_per_worker,
                   device_names=_device_names(cfg),
                   job={"target_path": cfg.target.path, "target_dtype": cfg.target.dtype,
                        "data_path": cfg.data.path, "token_budget": cfg.data.token_budget,
                        "target_devices": cfg.target.devices, "target_workers": cfg.target.num_workers,
                        "drafter_devices": cfg.drafter.devices, "drafter_workers": cfg.drafter.num_workers,
                        "drafter_layers": cfg.model.num_layers, "target_layer_ids": cfg.model.target_layer_ids,
                        "anchors_per_step": cfg.objective.anchors_per_step, "drafter_dtype": cfg.drafter.dtype},
                   target=target, drafter=drafter, e2e=e2e)
    return figures


def _device_names(cfg: JobConfig) -> dict:
    names = {}
    for device in sorted(set(cfg.target.devices) | set(cfg.drafter.devices)):
        if device.startswith("cuda") and torch.cuda.is_available():
            names[device] = torch.cuda.get_device_name(torch.device(device))
        else:
            names[device] = device
    return names


def worker_gpus(target: dict) -> str:
    k = target.get("gpus_per_worker", 1)
    return f" of {k} processes (tensor parallel)" if k > 1 else ""


def format_table(f: dict) -> str:
    """The human-readable result of :func:`run_pipeline_bench`."""
    job, t, d, e = f["job"], f["target"], f["drafter"], f["e2e"]
    tg, dg = f["target_gpus"], f["drafter_gpus"]
    early = " (the data ended first)" if e["finished_early"] else ""
    rows = [
        ("target capacity", ",".join(t.get("devices", [t["device"]])), t["seconds"], f["target_capacity"],
         f"{t['batches']} batches, one worker{worker_gpus(t)} alone, forward into a slot"),
        ("drafter capacity", d["device"], d["seconds"], f["drafter_capacity"],
         f"{d['steps']} steps of {d['step_s_mean'] * 1e3:.0f} ms, world size 1, random features"),
        ("end to end tok_rate", f"{e['targets']}+{e['drafters']} workers", e["window_s"], f["tok_rate"],
         f"{e['steps']} steps{early}; busy: targets {e['target_busy_fraction']:.0%}, "
         f"drafters {e['drafter_busy_fraction']:.0%}; tgt_rate {e['tgt_rate']:,.0f}"),
    ]
    lines = [f"pipeline benchmark: target {os.path.basename(job['target_path'])} ({job['target_dtype']}, layers "
             f"{job['target_layer_ids']}), drafter {job['drafter_layers']} layers, {job['anchors_per_step']} "
             f"anchors/step; {f['warmup_s']:g} s warmup + {f['seconds']:g} s per phase",
             f"  {'phase':<20} {'device':<14} {'measured':>9} {'tok/s':>12}  detail"]
    lines += [f"  {name:<20} {dev:<14} {secs:>7.1f} s {rate:>12,.0f}  {detail}"
              for name, dev, secs, rate, detail in rows]
    lines += [f"  pipeline capacity    min({tg} x {f['target_capacity']:,.0f}, {dg} x {f['drafter_capacity']:,.0f}) "
              f"= {f['pipeline_capacity']:,.0f} tok/s; bottleneck: {f['bottleneck']}",
              f"  ratio                tok_rate / pipeline capacity = {f['ratio']:.3f} (goal >= {f['goal']:.2f}: "
              f"{'met' if f['ratio'] >= f['goal'] else 'not met'})",
              f"  end-to-end run       {e['run_dir']} (startup to first step {e['startup_s']:.1f} s)"]
    return "\n".join(lines)
