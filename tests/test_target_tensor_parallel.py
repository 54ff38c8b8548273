"""target.gpus_per_worker: a target worker of K processes (transformers' tensor parallelism).

The checks at start are stepped in-process. `test_two_rank_worker_writes_the_features_of_one_rank`
spawns the two processes of one K=2 worker on CPU (gloo): the leader is the real `TargetWorker`
(its batches go to the follower through `WorkerGroup`), the follower the real `follow` loop, and
every target is loaded by transformers' own tensor-parallel plan (expert-parallel for the MoE
once more). The features the leader writes into its slot must equal a one-process worker's.
Tensor-parallel loading needs the `accelerate` package (transformers refuses without it): the
multi-process tests are skipped, with that reason, where it is missing.
"""

import importlib.util
import tempfile
import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from dflash_ipc.wire import protocol as p
from dflash_ipc.config.load import config_from_dict, load_config
from dflash_ipc.data.dataset import TokenDataset
from dflash_ipc.data.prepare import prepare_dataset
from dflash_ipc.dispatch.proc import plan_job
from dflash_ipc.errors import ConfigError
from dflash_ipc.config.machine import check_node_fits
from architectures import ARCHITECTURES, build_tiny_target_of
from dflash_ipc.hf.target_config import load_target_config
from dflash_ipc.target.tensor_parallel import check_tensor_parallel
from test_support_table import write_chats

needs_accelerate = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                      reason="transformers loads tensor-parallel models only with accelerate "
                                             "installed (pip install 'dflash-ipc[tp]')")
BATCHES = 3
NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


# --- the checks at start -----------------------------------------------------------------------


def test_devices_of_a_k_process_worker_and_the_device_rules():
    cfg = load_config(None, ["target.num_workers=3", "target.gpus_per_worker=2", "drafter.num_workers=2",
                             "target.devices=[cuda:0,cuda:1,cuda:2,cuda:3,cuda:4,cuda:5]",
                             "drafter.devices=[cuda:6,cuda:7]"])
    assert cfg.target.devices_of(1) == ["cuda:2", "cuda:3"] and cfg.target.device_of(2) == "cuda:4"
    assert load_config(None, ["target.gpus_per_worker=2"]).target.devices_of(4) == ["cpu", "cpu"]
    bad = {"target.devices=[cuda:0]": "one GPU cannot hold the 2 ranks",
           "target.devices=[cuda:0,cuda:1,cuda:2]": "list 4 devices",
           "target.devices=[cuda:0,cuda:1,cuda:1,cuda:2]": "cuda:1 is listed twice",
           "target.expert_parallel=true -o target.gpus_per_worker=1": "needs target.gpus_per_worker > 1"}
    for override, message in bad.items():
        overrides = ["target.num_workers=2", "target.gpus_per_worker=2", *override.split(" -o ")]
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)
    # a drafter may share a worker's GPU (2 H200s: a 2-GPU worker and a drafter beside its follower)
    shared = load_config(None, ["target.num_workers=1", "target.gpus_per_worker=2", "target.devices=[cuda:0,cuda:1]",
                                "drafter.num_workers=1", "drafter.devices=[cuda:1]"])
    assert shared.publish_sync_of(0) == "ipc_event"  # the leader's GPU, cuda:0, runs no drafter
    with pytest.raises(ConfigError, match="fsdp needs one GPU per drafter"):
        load_config(None, ["drafter.num_workers=3", "drafter.devices=[cuda:0,cuda:1,cuda:1]", "target.devices=[cuda:0]",
                           "drafter.sharding=fsdp"])


def test_the_node_must_hold_every_worker_gpu():
    cfg = load_config(None, ["target.num_workers=3", "target.gpus_per_worker=2", "drafter.num_workers=2",
                             "target.devices=[cuda:0,cuda:1,cuda:2,cuda:3,cuda:4,cuda:5]",
                             "drafter.devices=[cuda:6,cuda:7]"])
    check_node_fits(cfg, 8)
    with pytest.raises(ConfigError, match=r"needs 8 GPUs \(3 target workers of target.gpus_per_worker=2 processes "
                                          r"on 6 GPUs \(cuda:0, .*, cuda:5\), 2 drafters on 2 GPUs \(cuda:6, cuda:7\)\) "
                                          r"but this machine has 4 \(cuda:0..cuda:3\): "
                                          r"cuda:4, cuda:5, cuda:6, cuda:7 do not exist"):
        check_node_fits(cfg, 4)
    # Workers sharing a GPU: the count of workers and of distinct GPUs, both named.
    shared = load_config(None, ["target.num_workers=2", "target.devices=[cuda:0]", "drafter.num_workers=1",
                                "drafter.devices=[cuda:1]"])
    with pytest.raises(ConfigError, match=r"needs 2 GPUs \(2 target workers on 1 GPU \(cuda:0\), 1 drafter on "
                                          r"1 GPU \(cuda:1\)\) but this machine has 0 \(none\)"):
        check_node_fits(shared, 0)


def test_a_target_transformers_cannot_split_is_refused_by_name(tmp_path, monkeypatch):
    from transformers import GPT2Config
    GPT2Config(n_layer=2, n_embd=32, n_head=4).save_pretrained(tmp_path / "gpt2")
    split = config_from_dict({"target": {"gpus_per_worker": 2}}).target
    with pytest.raises(ConfigError, match=r"gpus_per_worker=2: .*gpt2 \(gpt2, GPT2Config\) has no tensor-parallel plan "
                                          r"in transformers"):
        check_tensor_parallel(split, load_target_config(str(tmp_path / "gpt2")), str(tmp_path / "gpt2"))
    qwen3 = build_tiny_target_of(ARCHITECTURES["qwen3"], str(tmp_path / "qwen3"))  # 4 heads, 2 KV heads
    config = load_target_config(qwen3)
    with pytest.raises(ConfigError, match="4 num_attention_heads, 2 num_key_value_heads, which 4 ranks cannot split "
                                          "evenly; allowed: 2"):
        check_tensor_parallel(config_from_dict({"target": {"gpus_per_worker": 4}}).target, config, qwen3)
    with pytest.raises(ConfigError, match="target.expert_parallel: .* has no expert-parallel plan"):
        check_tensor_parallel(config_from_dict({"target": {"gpus_per_worker": 2, "expert_parallel": True}}).target,
                              config, qwen3)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate"
                        else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"only with the accelerate package installed: pip install 'dflash-ipc\[tp\]'"):
        check_tensor_parallel(split, config, qwen3)


# --- a two-process worker against a one-process worker -------------------------------------------

CASES = [("qwen3", False), ("llama", False), ("qwen3_moe", False), ("qwen3_moe", True)]


def _job(target: str, data: str, k: int, expert_parallel: bool = False, devices=("cpu",)):
    return config_from_dict({"target": {"path": target, "gpus_per_worker": k, "expert_parallel": expert_parallel,
                                        "dtype": "float32", "num_workers": 1, "devices": list(devices)},
                             "data": {"path": data, "bucket_boundaries": [64, 128], "token_budget": 256},
                             "model": {"target_layer_ids": [1, 2]}})


def _batches(cfg) -> list[p.Batch]:
    planned = plan_job(cfg, TokenDataset(cfg.data.path).lengths)[0][:BATCHES]
    return [p.Batch(batch_id=b.batch_id, epoch=0, slot=0, sample_ids=list(b.sample_ids), padded_len=b.padded_len)
            for b in planned]


def _features(worker, batches) -> list[torch.Tensor]:
    out = []
    for batch in batches:
        produced = worker.produce(batch)
        out.append(worker.pool.write_view(0, produced.num_tokens).clone())
    return out


def _shard_fraction(capture, expert_parallel: bool) -> float:
    """Local / global elements of a split weight: 1/K if it is split."""
    layer = capture.layers[1]
    weight = layer.mlp.experts.gate_up_proj if expert_parallel else layer.self_attn.q_proj.weight
    return weight.to_local().numel() / weight.numel()


def _worker_rank(tp_rank: int, targets: dict, data: str, out_dir: str, devices: list[str]) -> None:
    from dflash_ipc.target.worker import TargetWorker, follow, load_capture
    from dflash_ipc.target.worker_group import ADDRESS_ENV, WorkerGroup
    from dflash_ipc.transport.backends import create_pool
    from dflash_ipc.transport.slots import SlotLayout
    torch.set_num_threads(1)
    device = devices[tp_rank] if len(devices) > 1 else devices[0]
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    os.environ[ADDRESS_ENV] = f"file://{out_dir}/rendezvous"
    first = _job(targets["qwen3"], data, 2, devices=devices)
    group = WorkerGroup.join(first, 0, tp_rank, device)
    results = {}
    try:
        for arch, expert_parallel in CASES:
            cfg = _job(targets[arch], data, 2, expert_parallel, devices=devices)
            capture = load_capture(cfg, device)
            dataset = TokenDataset(data)
            name = f"{arch}-ep" if expert_parallel else arch
            results[f"{name}.shard"] = _shard_fraction(capture, expert_parallel)
            if tp_rank > 0:
                follow(cfg, capture, dataset, group, device)
                continue
            layout = SlotLayout(num_slots=1, max_tokens=256, feature_dim=capture.feature_dim, dtype="float32")
            pool = create_pool(layout, device, name=f"dflash-test-tp-{os.getpid()}-{name}")
            try:
                results[name] = [f.cpu() for f in _features(TargetWorker(capture, dataset, pool, group), _batches(cfg))]
            finally:
                pool.close()
            group.end_of_work()  # the follower's `follow` returns
    finally:
        group.close(clean=True)
    torch.save(results, os.path.join(out_dir, f"rank{tp_rank}.pt"))


def _compare_with_one_rank(tmp_path, devices: list[str], tolerance: float) -> None:
    """Spawns the two ranks of a K=2 worker on `devices`, then checks its features against a
    one-process worker's on the first device."""
    from dflash_ipc.target.worker import TargetWorker, load_capture
    from dflash_ipc.transport.backends import create_pool
    from dflash_ipc.transport.slots import SlotLayout
    targets = {arch: build_tiny_target_of(ARCHITECTURES[arch], str(tmp_path / arch)) for arch in ("qwen3", "llama",
                                                                                                  "qwen3_moe")}
    data = str(tmp_path / "data")
    prepare_dataset(targets["qwen3"], write_chats(tmp_path / "chats.jsonl", num_chats=12), data, max_length=128,
                    progress=False)
    mp.start_processes(_worker_rank, args=(targets, data, str(tmp_path), devices), nprocs=2, join=True,
                       start_method="spawn")
    leader, follower = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for arch, expert_parallel in CASES:
        name = f"{arch}-ep" if expert_parallel else arch
        assert leader[f"{name}.shard"] == follower[f"{name}.shard"] == 0.5, name  # each rank holds half
        cfg = _job(targets[arch], data, 1, devices=devices[:1])
        capture = load_capture(cfg, devices[0])
        layout = SlotLayout(num_slots=1, max_tokens=256, feature_dim=capture.feature_dim, dtype="float32")
        pool = create_pool(layout, devices[0], name=f"dflash-test-tp-{os.getpid()}-{name}")
        try:
            reference = [f.cpu() for f in _features(TargetWorker(capture, TokenDataset(data), pool), _batches(cfg))]
        finally:
            pool.close()
        assert len(leader[name]) == BATCHES and sum(len(f) for f in reference) > 0
        for got, want in zip(leader[name], reference):
            torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance, msg=name)


@needs_accelerate
@pytest.mark.timeout(240)
def test_two_rank_worker_writes_the_features_of_one_rank(tmp_path):
    _compare_with_one_rank(tmp_path, ["cpu"], 1e-5)


@pytest.mark.gpu
@needs_accelerate
@pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.timeout(300)
def test_two_gpu_worker_writes_the_features_of_one_gpu(tmp_path):
    """The same on cuda:0 + cuda:1: NCCL inside the layers, each rank bound to its own GPU."""
    _compare_with_one_rank(tmp_path, ["cuda:0", "cuda:1"], 1e-4)


@needs_accelerate
@pytest.mark.timeout(180)
def test_bench_target_capacity_of_a_two_process_worker(tmp_path):
    """`bench pipeline`'s target phase with gpus_per_worker=2: this process leads, the follower is
    a real `dflash-ipc target --tp-rank 1` process, and both end cleanly."""
    from dflash_ipc.bench.pipeline import target_capacity
    target = build_tiny_target_of(ARCHITECTURES["qwen3"], str(tmp_path / "qwen3"))
    data = str(tmp_path / "data")
    prepare_dataset(target, write_chats(tmp_path / "chats.jsonl", num_chats=12), data, max_length=128, progress=False)
    cfg = _job(target, data, 2)
    cfg.run.run_dir = str(tmp_path / "run")
    def rendezvous_dirs():
        return {d for d in os.listdir(tempfile.gettempdir()) if d.startswith("dflash-bench-tp-")}
    before = rendezvous_dirs()
    figures = target_capacity(cfg, seconds=0.5, warmup_s=0.0)
    assert figures["gpus_per_worker"] == 2 and figures["devices"] == ["cpu", "cpu"]
    assert figures["batches"] >= 1 and figures["tokens"] > 0 and figures["tok_per_s"] > 0
    assert rendezvous_dirs() <= before  # the follower exited 0 and its folder is gone
