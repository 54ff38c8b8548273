"""drafter.compile: the compiled step is the eager step (short steps padded with filler blocks
under CUDA graphs), a flex step runs in whole tiles, and a compile that fails falls back to
eager with a log line and the same step."""

import copy
import logging

import pytest
import torch

from dflash_ipc.config.load import config_from_dict
from dflash_ipc.drafter import attention as att
from dflash_ipc.drafter.compiled_forward import DrafterForward
from dflash_ipc.drafter.step_shape import pad_layout
from dflash_ipc.drafter.trainer import DrafterTrainer
from dflash_ipc.errors import ConfigError
from tests.test_drafter_trainer import head, model_config, sequences

torch.set_num_threads(1)


def test_steps_on_flex_are_whole_attention_tiles():
    eager = DrafterForward(torch.nn.Linear(1, 1), "off", torch.device("cpu"))
    assert eager.step_rows(700, 48, tile=1, block_size=16) == (700, 48)
    assert eager.step_rows(700, 48, tile=128, block_size=16) == (768, 128)  # fillers: 5 blocks of 16
    assert eager.step_rows(768, 256, tile=128, block_size=16) == (768, 256)
    assert eager.step_rows(700, 50, tile=128, block_size=10) == (700, 50)  # blocks of 10 make no whole tile
    assert att.flex_kernel_options(32768, 40960) == {"IS_DIVISIBLE": True}
    assert att.flex_kernel_options(32768, 40961) is None and att.flex_kernel_options(48, 768) is None
    # the tiles measured faster for heads of 64 on an H100/H200 (sm90), and only there
    tiles = att.FLEX_TILES[((9, 0), 64)]
    assert att.flex_kernel_options(32768, 40960, 64, (9, 0)) == {"IS_DIVISIBLE": True, **tiles}
    assert att.flex_kernel_options(32768, 40961, 64, (9, 0)) == tiles
    assert att.flex_kernel_options(32768, 40960, 128, (9, 0)) == {"IS_DIVISIBLE": True}
    assert att.flex_kernel_options(32768, 40960, 64, (8, 0)) == {"IS_DIVISIBLE": True}
    assert att.cuda_arch(torch.device("cpu")) is None


def test_a_flex_step_runs_in_whole_tiles_with_the_dense_steps_loss():
    """The trainer pads a flex step to whole 128-tiles (context keys no query sees, filler
    blocks); its loss is the unpadded dense step's (forward only: CPU flex has no backward)."""
    def trainer(backend):
        cfg = config_from_dict({"drafter": {"num_workers": 1, "dtype": "float32", "attention": backend},
                                "objective": {"weighting": "decay", "anchors_per_step": 12,
                                              "max_anchors_per_seq": 6}})
        return DrafterTrainer(cfg, model_config(), head(), device="cpu", total_steps=2)
    chosen = [(s, s.num_anchors) for s in sequences(3, seed=8)]
    losses = []
    for backend in ("flex", "dense"):
        t = trainer(backend)
        batch, features, mask, _ = t._build(copy.deepcopy(chosen))
        tiles = backend == "flex"
        assert (batch.layout.num_queries % 128 == 0 and features.shape[0] % 128 == 0) == tiles
        assert batch.num_anchors == sum(n for _, n in chosen)
        with torch.no_grad():
            losses.append(t.loss_sum(batch, features, mask))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)


def test_under_cuda_graphs_every_step_builds_its_flex_masks_into_the_same_memory():
    """CUDA graphs take a flex mask's tensors as static inputs (a new address records the
    graphs again): under reduce-overhead a step's masks are the last step's objects, over the
    same buffers, holding this step's tiles and tables (forward only: CPU flex has no backward)."""
    cfg = config_from_dict({"drafter": {"num_workers": 1, "dtype": "float32", "attention": "flex"},
                            "objective": {"weighting": "decay", "anchors_per_step": 12, "max_anchors_per_seq": 6}})
    trainer = DrafterTrainer(cfg, model_config(), head(), device="cpu", total_steps=2)
    eager_masks = trainer.drafter_forward.mask_memory
    trainer.drafter_forward = DrafterForward(trainer.model, "reduce-overhead", trainer.device, backend="aot_eager",
                                             force=True)
    assert eager_masks is None and trainer.drafter_forward.mask_memory is not None
    seqs = sequences(6, seed=3)
    built = []
    for chosen in ([(s, s.num_anchors) for s in seqs[:3]], [(s, s.num_anchors) for s in seqs[3:]]):
        batch, features, masks, _ = trainer._build(copy.deepcopy(chosen))
        mask = masks["full_attention"]
        fresh = att.flex_block_mask(pad_layout(batch.layout, features.shape[0]))  # built on its own
        built.append((mask, [t.data_ptr() for t in mask.as_tuple() if isinstance(t, torch.Tensor)]))
        q = torch.arange(mask.seq_lengths[0])[:, None]
        k = torch.arange(mask.seq_lengths[1])[None, :]
        assert torch.equal(mask.mask_mod(0, 0, q, k), fresh.mask_mod(0, 0, q, k))  # this step's rule
        assert torch.equal(mask.kv_indices, fresh.kv_indices) and torch.equal(mask.q_num_blocks, fresh.q_num_blocks)
    (first, first_ptrs), (second, second_ptrs) = built
    assert second is first and second_ptrs == first_ptrs  # the object, and so every buffer it holds


def test_mask_memory_gives_a_new_shape_new_buffers():
    memory = att.MaskMemory()
    made = []

    def make(t):
        made.append(t)
        return object()
    a = memory.place("k", {"x": torch.zeros(4)}, make)
    b = memory.place("k", {"x": torch.ones(4)}, make)
    assert a is b and len(made) == 1 and torch.equal(made[0]["x"], torch.ones(4))
    c = memory.place("k", {"x": torch.ones(5)}, make)
    assert c is not a and len(made) == 2
    d = memory.place("k", {"x": torch.ones(5)}, make, static=(5, 9))  # what make depends on besides the shapes
    assert d is not c and len(made) == 3 and memory.place("k", {"x": torch.zeros(5)}, make, static=(5, 9)) is d
    assert len(memory._held) == 1  # one key, the latest shape: old buffers are not kept


def _cfg(**drafter):
    # The paper's recipe (decay weights, AdamW), the one these tolerances were set for: Muon's
    # orthogonalised update and D-PACE's weights (from the step's own CE) carry the compiled
    # forward's last-bit differences into the weights at a larger scale.
    return config_from_dict({"drafter": {"num_workers": 1, "dtype": "float32", "attention": "dense", **drafter},
                             "objective": {"weighting": "decay", "anchors_per_step": 12, "max_anchors_per_seq": 6},
                             "optimizer": {"name": "adamw"}})


def _steps(trainer, plan):
    return [trainer.step(copy.deepcopy(chosen)) for chosen in plan]


def _plan():
    seqs = sequences(6, seed=3)
    # a short last step: under CUDA graphs it runs with filler blocks up to the longest step's
    return [[(s, s.num_anchors) for s in seqs[i:i + 3]] for i in (0, 3)] + [[(seqs[0], 2)]]


def _trainer(forward_mode=None, backend="aot_eager"):
    trainer = DrafterTrainer(_cfg(), model_config(), head(), device="cpu", total_steps=4)
    if forward_mode is not None:
        trainer.drafter_forward = DrafterForward(trainer.model, forward_mode, trainer.device, backend=backend,
                                                 force=True)
    return trainer


def _assert_same_steps(got_trainer, got, want_trainer, want):
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4)
    for (name, p), q in zip(got_trainer.model.named_parameters(), want_trainer.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_step_is_the_eager_step(mode):
    # aot_eager: dynamo's graph and AOT autograd's forward/backward split, run without
    # codegen (inductor's kernels are the GPU test's); reduce-overhead also pads the context
    plan = _plan()
    eager = _trainer()
    want = _steps(eager, plan)
    compiled = _trainer(mode)
    got = _steps(compiled, plan)
    assert compiled.drafter_forward.enabled and compiled.drafter_forward.failure is None
    assert compiled.drafter_forward.cuda_graphs == (mode == "reduce-overhead")
    _assert_same_steps(compiled, got, eager, want)


def _broken_backward(gm, example_inputs):
    from torch._dynamo.backends.common import aot_autograd

    def fail(bw_gm, bw_inputs):
        raise RuntimeError("backward codegen exploded")
    return aot_autograd(fw_compiler=lambda fw_gm, fw_inputs: fw_gm, bw_compiler=fail)(gm, example_inputs)


@pytest.mark.parametrize("backend", [_broken_backward, "broken_forward"])
def test_a_failed_compile_falls_back_to_eager_with_a_log_line(backend, caplog):
    def broken_forward(gm, example_inputs):
        raise RuntimeError("forward codegen exploded")
    plan = _plan()
    eager = _trainer()
    want = _steps(eager, plan)
    trainer = _trainer("default", backend=broken_forward if backend == "broken_forward" else backend)
    with caplog.at_level(logging.WARNING, logger="dflash_ipc.drafter.compiled_forward"):
        got = _steps(trainer, plan)
    assert not trainer.drafter_forward.enabled and "exploded" in trainer.drafter_forward.failure
    warnings = [r for r in caplog.records if "drafter.compile=default failed" in r.getMessage()]
    assert len(warnings) == 1 and "runs eagerly" in warnings[0].getMessage()
    _assert_same_steps(trainer, got, eager, want)


@pytest.mark.slow  # ~12 s each on two shared cores: dynamo tracing torchao's float8 tensors
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_layers_in_the_graph_give_the_numbers_of_the_eager_fp8_step(monkeypatch, recipe):
    # float8 emulated (torchao's emulate: float8-rounded operands, float32 matmuls): the layers
    # traced into one graph, their shared casts merged, against each layer on its own
    pytest.importorskip("torchao.float8", reason="needs torchao (pip install 'dflash-ipc[fp8]')")
    monkeypatch.setenv("DFLASH_FP8_EMULATE", "1")
    plan = _plan()[:1]  # one step: tracing torchao's float8 tensors is the slow part

    def fp8_trainer(mode):
        cfg = _cfg(precision="fp8", dtype="bfloat16", compile=mode, fp8_recipe=recipe)
        trainer = DrafterTrainer(cfg, model_config(), head(), device="cpu", total_steps=4)
        if mode != "off":
            trainer.drafter_forward = DrafterForward(trainer.model, mode, trainer.device, backend="aot_eager",
                                                     force=True, row_multiple=16)
        return trainer
    eager = fp8_trainer("off")
    want = _steps(eager, plan)
    compiled = fp8_trainer("default")
    assert type(compiled.model.fc.forward).__name__ == "_GraphForward"
    got = _steps(compiled, plan)
    assert compiled.drafter_forward.enabled and compiled.drafter_forward.failure is None
    assert compiled.drafter_forward.step_rows(70, 32, tile=1, block_size=16) == (80, 32)
    _assert_same_steps(compiled, got, eager, want)


def test_what_falls_back_and_what_propagates():
    from dflash_ipc.drafter.compiled_forward import falls_back
    assert falls_back(torch._dynamo.exc.TorchDynamoException("backend failed"))
    assert falls_back(RuntimeError("CUDAGraphs: accessing an overwritten output"))
    assert not falls_back(torch.OutOfMemoryError("CUDA out of memory"))
    assert not falls_back(KeyboardInterrupt()) and not falls_back(ConfigError("bad"))


def test_compile_is_eager_on_cpu_unless_forced_and_config_checks(caplog):
    with caplog.at_level(logging.INFO, logger="dflash_ipc.drafter.compiled_forward"):
        trainer = DrafterTrainer(_cfg(compile="reduce-overhead"), model_config(), head(), device="cpu",
                                 total_steps=2)
    assert not trainer.drafter_forward.enabled and trainer.drafter_forward.step_rows(700, 48, tile=1, block_size=4) == (700, 48)
    assert any("compiles on CUDA only" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match="drafter.compile"):
        _cfg(compile="default", sharding="fsdp")
    with pytest.raises(ConfigError, match="allowed"):
        _cfg(compile="max-autotune")
    with pytest.raises(ConfigError, match="lm_head_chunk_gib"):
        _cfg(lm_head_chunk_gib=-1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["reduce-overhead"])  # the most moving parts; bench drafter_speed runs the rest
def test_compiled_step_on_gpu_is_the_eager_step_with_flex(mode):
    # inductor's kernels and FlexAttention inside the one graph, CUDA graphs, a padded context; bf16
    from dflash_ipc.bench import drafter as bd
    sizes = dict(steps=2, shape="tiny", anchors_per_seq=16, num_seqs=2, seq_len=300, warmup=1)
    eager = bd.run_drafter_bench("cuda:0", variant={"precision": "bf16", "compile": "off"}, **sizes)
    compiled = bd.run_drafter_bench("cuda:0", variant={"precision": "bf16", "compile": mode}, **sizes)
    torch._dynamo.reset()
    assert compiled["compile_active"] and compiled["compile_failure"] is None
    assert compiled["loss_last"] == pytest.approx(eager["loss_last"], rel=2e-2)
    assert compiled["compiles_warmup"]["frames"] >= 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_steps_launched_back_to_back_replay_the_graphs_they_recorded(monkeypatch):
    """Ragged steps, synchronised and then launched back to back (bench drafter's pipelined
    steps, as the drafter loop runs them): the forward and the backward are recorded once
    each. With each step's flex masks at fresh addresses, the pipelined steps recorded them
    again (attention.MaskMemory)."""
    from torch._inductor import cudagraph_trees

    from dflash_ipc.bench import drafter as bd
    recorded = []
    record = cudagraph_trees.CUDAGraphTreeManager.record_function  # torch's internal: counted, then run

    def counting(self, *args, **kwargs):
        recorded.append(1)
        return record(self, *args, **kwargs)
    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function", counting)
    f = bd.run_drafter_bench("cuda:0", variant={"precision": "bf16", "compile": "reduce-overhead"}, steps=4,
                             shape="tiny", anchors_per_seq=16, num_seqs=2, seq_len=512, warmup=2, ragged=True)
    torch._dynamo.reset()
    assert f["compile_active"] and f["compile_failure"] is None and "pipelined_step_s_mean" in f
    assert len(recorded) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["reduce-overhead"])
def test_fp8_in_the_compiled_graph_on_gpu_is_the_fp8_step(mode):
    pytest.importorskip("torchao.float8", reason="needs torchao (pip install 'dflash-ipc[fp8]')")
    if torch.cuda.get_device_capability(0) < (8, 9):
        pytest.skip("needs compute capability >= 8.9")
    from dflash_ipc.bench import drafter as bd
    from dflash_ipc.drafter.precision import reset_compiled_layers
    sizes = dict(steps=2, shape="tiny", anchors_per_seq=16, num_seqs=2, seq_len=300, warmup=1)
    fp8 = {"precision": "fp8", "fp8_recipe": "tensorwise", "fp8_lm_head": "all"}
    eager = bd.run_drafter_bench("cuda:0", variant={**fp8, "compile": "off"}, **sizes)
    reset_compiled_layers()
    compiled = bd.run_drafter_bench("cuda:0", variant={**fp8, "compile": mode}, **sizes)
    reset_compiled_layers()
    assert compiled["compile_active"] and compiled["compile_failure"] is None
    assert compiled["loss_last"] == pytest.approx(eager["loss_last"], rel=2e-2)
