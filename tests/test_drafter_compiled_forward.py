"""drafter.compile: the padded context changes nothing, the compiled step is the eager step,
and a compile that fails falls back to eager with a log line and the same step."""

import copy
import logging

import pytest
import torch

from dflash_ipc.config.load import config_from_dict
from dflash_ipc.drafter import attention as att
from dflash_ipc.drafter.compiled_forward import (DrafterForward, StepRows, context_bucket, pad_blocks, pad_layout,
                                                 pad_rows)
from dflash_ipc.drafter.objective import build_training_batch
from dflash_ipc.drafter.trainer import DrafterTrainer
from dflash_ipc.errors import ConfigError
from tests.test_drafter_trainer import head, model_config, sequences

torch.set_num_threads(1)


def test_context_buckets_are_few_and_pad_by_at_most_half():
    assert [context_bucket(n) for n in (0, 1, 1024, 1025, 1536, 1537, 2048, 2049, 8192, 8193)] == [
        1024, 1024, 1024, 1536, 1536, 2048, 2048, 3072, 8192, 12288]
    sizes = {context_bucket(n) for n in range(1, 65537, 37)}
    assert len(sizes) == 13  # 1K..64K: two per octave
    assert all(n <= context_bucket(n) <= max(1024, 1.5 * n) for n in range(1, 20000, 7))
    with pytest.raises(ValueError):
        context_bucket(-1)


def test_step_rows_are_the_largest_the_job_has_run(caplog):
    rows = StepRows()
    with caplog.at_level(logging.INFO, logger="dflash_ipc.drafter.compiled_forward"):
        got = [rows.pad(c, q) for c, q in ((5000, 64), (900, 64), (7000, 64), (6000, 32), (3000, 64))]
    assert got == [(6144, 64), (6144, 64), (8192, 64), (8192, 64), (8192, 64)]
    grown = [r.getMessage() for r in caplog.records if "outgrows" in r.getMessage()]
    assert len(grown) == 1 and "8192 x 64" in grown[0]  # the first step sets the marks, without a line
    assert rows.pad(100, 80) == (8192, 80)


def test_steps_on_flex_are_whole_attention_tiles():
    eager = DrafterForward(torch.nn.Linear(1, 1), "off", torch.device("cpu"))
    assert eager.step_rows(700, 48) == (700, 48)
    assert eager.step_rows(700, 48, tile=128, block_size=16) == (768, 128)  # fillers: 5 blocks of 16
    assert eager.step_rows(768, 256, tile=128, block_size=16) == (768, 256)
    assert eager.step_rows(700, 50, tile=128, block_size=10) == (700, 50)  # blocks of 10 make no whole tile
    assert att.flex_kernel_options(32768, 40960) == {"IS_DIVISIBLE": True}
    assert att.flex_kernel_options(32768, 40961) is None and att.flex_kernel_options(48, 768) is None


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


def _layout_and_mask_case():
    lengths, anchors = [11, 7], [torch.tensor([2, 5, 8]), torch.tensor([0, 4])]
    cu = torch.tensor([0, 11, 18], dtype=torch.int32)
    ids = torch.randint(0, 50, (18,), generator=torch.Generator().manual_seed(0))
    batch = build_training_batch(ids, torch.ones(18, dtype=torch.bool), cu, anchors, block_size=4,
                                 mask_token_id=63, gamma=7.0)
    return batch, lengths


def test_padding_keys_are_seen_by_no_query_dense_and_flex():
    batch, _ = _layout_and_mask_case()
    layout = batch.layout
    padded = pad_layout(layout, 40)
    assert padded.num_ctx == 40 and padded.num_queries == layout.num_queries
    dense, dense_padded = att.dense_mask(layout), att.dense_mask(padded)
    t = layout.num_ctx
    assert not dense_padded[:, t:40].any()  # the padding keys
    assert torch.equal(dense_padded[:, :t], dense[:, :t]) and torch.equal(dense_padded[:, 40:], dense[:, t:])
    bm = att.flex_block_mask(padded)  # the flex builder's tiles agree with the padded dense mask
    partial, full = att.flex_tile_flags(padded)
    want = torch.zeros(-(-padded.num_queries // 128), -(-(40 + padded.num_queries) // 128), dtype=torch.bool)
    want[0, 0] = True
    assert torch.equal(partial | full, want) and bm.shape[-1] == 40 + padded.num_queries
    windowed, windowed_padded = att.dense_mask(layout, 3), att.dense_mask(padded, 3)  # a sliding layer's
    assert not windowed_padded[:, t:40].any() and torch.equal(windowed_padded[:, 40:], windowed[:, t:])
    assert torch.equal(windowed_padded[:, :t], windowed[:, :t])
    assert pad_layout(layout, t) is layout
    with pytest.raises(ValueError):
        pad_layout(layout, t - 1)


def test_padded_context_gives_the_same_outputs_and_gradients():
    batch, _ = _layout_and_mask_case()
    torch.manual_seed(0)
    from dflash_ipc.drafter.model import DFlashDraftModel
    model = DFlashDraftModel(model_config())
    features = torch.randn(batch.layout.num_ctx, 64)
    embeds = torch.randn(batch.layout.num_queries, 32)
    runs = []
    for rows in (batch.layout.num_ctx, 31):
        model.zero_grad(set_to_none=True)
        mask = att.build_mask(pad_layout(batch.layout, rows), "dense")
        out = model(pad_rows(features, rows), pad_rows(batch.layout.ctx_pos.long(), rows), embeds,
                    batch.block_positions, mask)
        (out.square() * torch.arange(out.numel()).view_as(out)).sum().backward()
        runs.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-5, atol=1e-6)
    for name, grad in runs[0][1].items():
        torch.testing.assert_close(runs[1][1][name], grad, rtol=1e-5, atol=1e-5, msg=name)  # sums reordered


def test_filler_blocks_see_only_their_own_keys_and_carry_no_weight():
    batch, _ = _layout_and_mask_case()
    padded = pad_blocks(batch, batch.layout.num_queries + 8, mask_token_id=63)
    q, t = batch.layout.num_queries, batch.layout.num_ctx
    assert padded.num_anchors == batch.num_anchors and torch.equal(padded.loss_rows, batch.loss_rows)
    assert not padded.weights[q:].any() and torch.equal(padded.block_ids[q:], torch.full((8,), 63))
    assert torch.equal(padded.block_positions[q:], torch.tensor([0, 1, 2, 3] * 2))
    dense, dense_padded = att.dense_mask(batch.layout), att.dense_mask(padded.layout)
    assert torch.equal(dense_padded[:q, :t + q], dense)  # real queries: as before, no filler key
    assert not dense_padded[:q, t + q:].any()
    own = torch.zeros(8, t + q + 8, dtype=torch.bool)
    own[:4, t + q:t + q + 4] = own[4:, t + q + 4:] = True
    assert torch.equal(dense_padded[q:], own)  # fillers: their own block, nothing else
    partial, full = att.flex_tile_flags(padded.layout)
    assert torch.equal(partial | full, torch.ones(1, 1, dtype=torch.bool))
    assert pad_blocks(batch, q, 63) is batch
    for bad in (q - 4, q + 3):
        with pytest.raises(ValueError, match="whole blocks"):
            pad_blocks(batch, bad, 63)


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_filler_blocks_change_no_loss_gradient_or_acceptance(weighting):
    from dflash_ipc.drafter.acceptance_proxy import block_acceptance_totals
    cfg = config_from_dict({"drafter": {"num_workers": 1, "dtype": "float32", "attention": "dense"},
                            "objective": {"weighting": weighting, "anchors_per_step": 12, "max_anchors_per_seq": 6}})
    trainer = DrafterTrainer(cfg, model_config(), head(), device="cpu", total_steps=2)
    chosen = [(s, s.num_anchors) for s in sequences(3, seed=5)]
    batch, features, mask, _ = trainer._build(chosen)
    config = trainer.model.config
    runs = []
    for extra in (0, 3 * config.block_size):
        trainer.model.zero_grad(set_to_none=True)
        b = pad_blocks(batch, batch.layout.num_queries + extra, config.mask_token_id)
        m = att.build_layer_masks(b.layout, "dense", config.layer_types, config.sliding_window)
        loss, totals = trainer.loss_sum(b, features, m, acceptance=True)
        loss.backward()
        runs.append((loss.detach(), totals, {n: p.grad.clone() for n, p in trainer.model.named_parameters()}))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-6, atol=1e-6)
    assert torch.equal(runs[1][1], runs[0][1]) and runs[0][1][0] > 0
    for name, grad in runs[0][2].items():
        torch.testing.assert_close(runs[1][2][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    hidden = torch.randn(batch.layout.num_queries + 8, config.hidden_size)
    padded = pad_blocks(batch, batch.layout.num_queries + 8, config.mask_token_id)
    assert torch.equal(block_acceptance_totals(hidden, trainer.head.lm_head_weight, padded.labels, padded.weights,
                                               config.block_size),
                       block_acceptance_totals(hidden[:-8], trainer.head.lm_head_weight, batch.labels,
                                               batch.weights, config.block_size))


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
    assert compiled.drafter_forward.step_rows(70, 32) == (80, 32)
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
    assert not trainer.drafter_forward.enabled and trainer.drafter_forward.step_rows(700, 48) == (700, 48)
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
