"""The drafter step benchmark on the tiny shape (CPU), and its FLOP count against hand
counts and against torch's FlopCounterMode on a real training step."""

import collections
import logging
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dflash_ipc.bench import drafter as bd
from dflash_ipc.drafter import attention as att
from dflash_ipc.drafter.objective import build_training_batch
from dflash_ipc.errors import ConfigError

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny():
    """A tiny-shape trainer and the chosen sequences of one step (not yet taken)."""
    config = bd.drafter_model_config("tiny")
    dev = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    cfg = bd.bench_job_config(dev, objective={"max_anchors_per_seq": 16, "anchors_per_step": 32})
    assert (cfg.objective.weighting, cfg.optimizer.name, cfg.objective.anchors_per_step) == ("decay", "adamw", 32)
    trainer = bd._RecordingTrainer(cfg, config, bd.random_head(config, dev, gen), device="cpu",
                                   total_steps=4)
    seqs = bd.random_sequences(config, step=0, num_seqs=2, seq_len=128, max_anchors=16, device=dev, gen=gen,
                               cpu_gen=torch.Generator().manual_seed(1))
    return config, trainer, seqs


def test_bench_runs_on_tiny_shape_with_sane_figures(capsys):
    f = bd.run_drafter_bench("cpu", steps=2, shape="tiny", anchors_per_seq=16, num_seqs=2, seq_len=128, warmup=1)
    report = capsys.readouterr().out
    assert "MFU" in report and "mask build" in report and "step time" in report
    assert f["attention"] == "dense" and f["steps"] == 2 and len(f["warmup_step_s"]) == 1
    assert f["num_queries"] == 2 * 16 * 16 and f["num_ctx"] == 2 * 128 and f["anchors_per_step"] == 32
    assert 0 < f["step_s_min"] <= f["step_s_mean"] <= f["step_s_max"]
    assert 0 < f["mask_s_mean"] < f["step_s_mean"]
    assert f["sequences_per_s"] == pytest.approx(2 / f["step_s_mean"])
    assert f["query_tokens_per_s"] == pytest.approx(512 / f["step_s_mean"])
    assert f["peak_memory_gib"] is None  # CPU: no allocator statistics
    # On CPU the peak is one 256-edge bf16 matmul's measured rate, which the step's own matmuls
    # can beat on a busy 2-core machine (1.09 seen): MFU below 1 is a GPU fact, not a CPU one
    assert f["matmul_tflops"] > 0 and f["mfu"] > 0 and math.isfinite(f["mfu"])
    assert f["tflops"] == pytest.approx(f["flops_per_step"] / f["step_s_mean"] / 1e12)
    assert f["flops_per_step"] < f["flops_tile_per_step"] <= f["flops_dense_per_step"]
    assert sum(f["flops_breakdown"].values()) == pytest.approx(f["flops_per_step"])
    # random features, near-uniform logits at init: the loss is about ln(vocab)
    assert abs(f["loss_last"] - math.log(512)) < 0.5
    # the steps as the loop runs them on a GPU: launched back to back
    assert f["pipelined_step_s_mean"] > 0 and f["pipelined_mfu"] > 0 and "pipelined" in report
    low, high = f["pipelined_step_s_range"]  # one step's wall time: a slow one shows against the mean
    assert 0 < low <= high and "one step" in report
    assert "host_syncs" not in f  # CUDA's sync debug mode only


def test_forward_flops_match_a_hand_count():
    # tiny: H=64, 2 features -> F=128, 4 heads x 16 -> 64, 2 kv heads x 16 -> 32, I=128, V=512, 2 layers
    config = bd.drafter_model_config("tiny")
    t, q, r, p = 10, 32, 25, 300
    fc = 2 * t * 128 * 64
    ctx_k = ctx_v = 2 * t * 64 * 32
    q_proj, k_proj, v_proj, o_proj = 2 * q * 64 * 64, 2 * q * 64 * 32, 2 * q * 64 * 32, 2 * q * 64 * 64
    scores = values = 4 * (2 * p * 16)  # 4 heads, head_dim 16
    gate = up = 2 * q * 64 * 128
    down = 2 * q * 128 * 64
    lm = 2 * r * 64 * 512
    want = {"fc": fc, "context_kv": 2 * (ctx_k + ctx_v), "block_proj": 2 * (q_proj + k_proj + v_proj + o_proj),
            "attention": 2 * (scores + values), "mlp": 2 * (gate + up + down), "lm_head": lm}
    got = bd.forward_flops(config, num_ctx=t, num_queries=q, num_loss_rows=r, attention_pairs=p)
    assert got == want
    counts = bd.StepCounts(num_ctx=t, num_queries=q, num_loss_rows=r, visible_pairs=p, dense_pairs=q * (t + q),
                           tile_pairs=0)
    train = bd.training_flops(config, counts)
    assert train["total"] == 2 * fc + 3 * (want["context_kv"] + want["block_proj"] + want["attention"]
                                           + want["mlp"]) + 2 * lm
    with pytest.raises(ConfigError, match="visible, dense, tile"):
        bd.training_flops(config, counts, pairs="sparse")


def _check_counts_against_dense_mask(batch) -> None:
    counts = bd.step_counts(batch)
    mask = att.dense_mask(batch.layout)  # [Q, T+Q]
    assert counts.num_queries == mask.shape[0] and counts.num_ctx + counts.num_queries == mask.shape[1]
    assert counts.visible_pairs == int(mask.sum())
    assert counts.dense_pairs == mask.numel()
    assert counts.num_loss_rows == int((batch.weights != 0).sum())
    # pairs inside every 128x128 tile that holds a visible pair (ragged edges clipped)
    tile = att.FLEX_TILE
    qt, kt = -(-mask.shape[0] // tile), -(-mask.shape[1] // tile)
    padded = torch.zeros(qt * tile, kt * tile, dtype=torch.bool)
    padded[: mask.shape[0], : mask.shape[1]] = mask
    inside = torch.zeros_like(padded, dtype=torch.int64)
    inside[: mask.shape[0], : mask.shape[1]] = 1
    used = padded.view(qt, tile, kt, tile).any(3).any(1)  # [QT, KT]
    area = inside.view(qt, tile, kt, tile).sum((1, 3))
    assert counts.tile_pairs == int(area[used].sum())


def test_step_counts_match_the_dense_mask(tiny):
    config, trainer, seqs = tiny
    trainer.step(trainer.take(collections.deque(seqs)))
    batch = trainer.last_batch
    assert batch.layout.num_queries == 512 and batch.layout.num_ctx == 256
    assert 0 < int((batch.weights != 0).sum()) <= 32 * 15  # block position 0 never carries loss
    _check_counts_against_dense_mask(batch)


def test_step_counts_on_ragged_sizes():
    # Q and T+Q not multiples of the 128 tile; loss mask with holes
    lengths, gen = (300, 77, 190), torch.Generator().manual_seed(3)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    loss_mask = torch.rand(int(cu[-1]), generator=gen) > 0.2
    anchors = [torch.randperm(n - 2, generator=gen)[:k].sort().values for n, k in zip(lengths, (9, 4, 7))]
    batch = build_training_batch(torch.zeros(int(cu[-1]), dtype=torch.long), loss_mask, cu, anchors,
                                 block_size=16, mask_token_id=0, gamma=7.0)
    assert batch.layout.num_queries % 128 and (batch.layout.num_ctx + batch.layout.num_queries) % 128
    _check_counts_against_dense_mask(batch)


def test_training_flops_equal_flop_counter_on_a_real_step(tiny):
    # The math SDPA kernel runs attention as bmm's, which FlopCounterMode counts (the CPU
    # flash kernel is not counted), so a real step must count exactly the dense-equivalent.
    config, trainer, seqs = tiny
    chosen = trainer.take(collections.deque(seqs))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        trainer.step(chosen)
    counts = bd.step_counts(trainer.last_batch)
    dense = bd.training_flops(config, counts, pairs="dense")
    assert counter.get_total_flops() == dense["total"]
    visible = bd.training_flops(config, counts)
    assert visible["total"] == dense["total"] - dense["attention"] + visible["attention"]


def test_flex_compile_is_shape_dynamic():
    # No recompilation across layouts of different query and key counts (a static compile
    # recompiles on the first change). aot_eager: the Triton kernel needs a GPU. The first
    # call may hand the backend two graphs (dynamo restarts once to specialize the float
    # scale); what matters is that later shapes add none.
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(att.flex_attention, backend=counter, **att.FLEX_COMPILE_OPTIONS)
    compiled_after_first = None
    for lengths in [(700, 130, 450), (300, 200), (512, 256, 128, 128)]:
        gen = torch.Generator().manual_seed(0)
        anchors = [torch.randperm(n - 1, generator=gen)[:20].sort().values for n in lengths]
        cu = torch.tensor([0, *lengths]).cumsum(0)
        total = int(cu[-1])
        layout = build_training_batch(torch.zeros(total, dtype=torch.long), torch.ones(total, dtype=torch.bool), cu,
                                      anchors, block_size=16, mask_token_id=0, gamma=7.0).layout
        q = torch.randn(1, 4, layout.num_queries, 16, generator=gen)
        k = torch.randn(1, 2, layout.num_ctx + layout.num_queries, 16, generator=gen)
        v = torch.randn(1, 2, layout.num_ctx + layout.num_queries, 16, generator=gen)
        out = fn(q, k, v, block_mask=att.flex_block_mask(layout), scale=0.25, enable_gqa=True)
        want = att.attention(q[0], k[0], v[0], att.dense_mask(layout))
        torch.testing.assert_close(out[0], want, rtol=1e-5, atol=1e-5)
        compiled_after_first = compiled_after_first or counter.frame_count
    assert counter.frame_count == compiled_after_first >= 1
    torch._dynamo.reset()


def test_bad_arguments_raise_config_errors():
    with pytest.raises(ConfigError, match="qwen3-8b"):
        bd.drafter_model_config("llama")
    with pytest.raises(ConfigError, match="seq_len-1"):
        bd.run_drafter_bench("cpu", shape="tiny", anchors_per_seq=200, num_seqs=1, seq_len=128)
    with pytest.raises(ConfigError, match="steps"):
        bd.run_drafter_bench("cpu", steps=0, shape="tiny")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            bd.run_drafter_bench("cuda:0", shape="tiny", anchors_per_seq=16, num_seqs=2, seq_len=128)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_runs_on_gpu_with_flex_and_memory_figures():
    f = bd.run_drafter_bench("cuda:0", steps=2, shape="tiny", anchors_per_seq=16, num_seqs=2, seq_len=128,
                             warmup=1)
    assert f["attention"] == "flex" and f["peak_memory_gib"] > 0 and 0 < f["mfu"] < 1
    # the batch goes to the GPU in one non-blocking copy: no pageable copy waits for the stream
    syncs = f["host_syncs"]
    assert not [where for where in syncs if "objective.py" in where or "host_copy.py" in where], syncs


def test_precision_variants_in_order_and_bad_names_refused():
    variants = bd.precision_variants(["bf16", "fp8"], ["tensorwise", "rowwise"], ["all", "grad"])
    assert variants[0] == {"precision": "bf16", "compile": "off"} and len(variants) == 5
    assert [bd.variant_label(v) for v in variants[1:3]] == ["fp8 tensorwise, lm_head all",
                                                           "fp8 tensorwise, lm_head grad"]
    with pytest.raises(ConfigError, match="precision fp16 not allowed; allowed: bf16, fp8"):
        bd.precision_variants(["fp16"])
    with pytest.raises(ConfigError, match="fp8 recipe blockwise not allowed; allowed: tensorwise, rowwise"):
        bd.precision_variants(["fp8"], ["blockwise"])
    with pytest.raises(ConfigError, match=r"precision \(none\) not allowed"):
        bd.precision_variants([])
    shared = bd.precision_variants(["fp8"], shared_casts=["off", "on"])
    assert "fp8_shared_casts" not in shared[0] and shared[1]["fp8_shared_casts"] is True
    assert bd.variant_label(shared[1]) == "fp8 tensorwise, lm_head all, shared casts"
    with pytest.raises(ConfigError, match="fp8 shared casts maybe not allowed; allowed: on, off"):
        bd.precision_variants(["fp8"], shared_casts=["maybe"])


def test_bench_config_holds_on_a_gpu_device():
    # A job config refuses CPU targets with CUDA drafters: the bench's targets follow its device.
    cfg = bd.bench_job_config(torch.device("cuda:0"), drafter={"precision": "fp8"}, objective={"anchors_per_step": 8})
    assert cfg.drafter.devices == ["cuda:0"] and cfg.target.devices == ["cuda:0"]
    assert cfg.drafter.precision == "fp8" and cfg.objective.anchors_per_step == 8


def test_comparison_table_gives_the_speedup_against_the_first():
    base = {"shape": "tiny", "device": "cpu", "precision": "bf16", "step_s_mean": 0.5, "query_tokens_per_s": 2000.0,
            "context_tokens_per_s": 1000.0, "peak_memory_gib": 10.0, "mfu": 0.2, "timed_steps_compiling": []}
    fast = {**base, "precision": "fp8 tensorwise, lm_head all", "step_s_mean": 0.25, "query_tokens_per_s": 4000.0,
            "context_tokens_per_s": 2000.0, "peak_memory_gib": None, "mfu": 0.4, "timed_steps_compiling": [3]}
    broken = {**base, "precision": "bf16, compile default", "compile_mode": "default", "compile_active": False,
              "compile_failure": "BackendCompilerFailed: ..."}
    on_cpu = {**broken, "compile_failure": None}
    lines = bd.format_comparison([base, fast, broken, on_cpu]).splitlines()
    assert "speedup" in lines[1] and lines[2].split()[-2:] == ["1.00x", "none"] and "20.0%" in lines[2]
    assert lines[3].split()[-2:] == ["2.00x", "[3]"] and "4,000" in lines[3] and "n/a" in lines[3]
    assert "40.0%" in lines[3] and "(fell back to eager)" in lines[4] and "(eager: CUDA only)" in lines[5]


def test_bench_compares_precisions_in_one_run_on_cpu(monkeypatch, capsys):
    pytest.importorskip("torchao.float8", reason="needs torchao (pip install 'dflash-ipc[fp8]')")
    monkeypatch.setenv("DFLASH_FP8_EMULATE", "1")
    results = bd.compare_precisions("cpu", steps=1, shape="tiny", variants=bd.precision_variants(["bf16", "fp8"]),
                                    anchors_per_seq=8, num_seqs=2, seq_len=64, warmup=0)
    assert [f["precision"] for f in results] == ["bf16", "fp8 tensorwise, lm_head all"]
    assert results[1]["variant"] == {"precision": "fp8", "fp8_recipe": "tensorwise", "fp8_lm_head": "all", "compile": "off"}
    out = capsys.readouterr().out
    assert "comparison: tiny on cpu" in out and out.count("drafter step benchmark") == 2
    assert abs(results[1]["loss_last"] - results[0]["loss_last"]) < 0.05  # same init, same data


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_compares_bf16_and_fp8_on_gpu():
    pytest.importorskip("torchao.float8", reason="needs torchao (pip install 'dflash-ipc[fp8]')")
    if torch.cuda.get_device_capability(0) < (8, 9):
        pytest.skip("needs compute capability >= 8.9")
    results = bd.compare_precisions("cuda:0", steps=2, shape="tiny", variants=bd.precision_variants(["bf16", "fp8"]),
                                    anchors_per_seq=16, num_seqs=2, seq_len=128, warmup=1)
    assert results[1]["fp8_matmul_tflops"] > 0 and results[1]["peak_memory_gib"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_profiles_the_kernels_of_a_step_on_gpu(capsys):
    f = bd.run_drafter_bench("cuda:0", steps=1, shape="tiny", anchors_per_seq=16, num_seqs=2, seq_len=128,
                             warmup=1, profile_steps=2)
    profile = f["kernel_profile"]
    assert profile["steps"] == 2 and profile["total_ms"] > 0
    assert profile["ms_per_step"]["matmul"] > 0 and profile["ms_per_step"]["attention"] > 0
    assert "kernel time per step (bf16, 2 profiled steps)" in capsys.readouterr().out


def test_kernel_kinds_and_the_summary_per_step():
    from dflash_ipc.bench.kernel_profile import KINDS, format_profile, kernel_kind, summarize
    names = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1": "matmul",
        "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN": "matmul",
        "sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n_tilesize128x128x128": "matmul fp8",
        "nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT": "matmul fp8",
        "nvjet_sm90_qqtst_192x192_128x4_2x1_v_bz_coopB_TNN": "matmul fp8",
        "triton_tem_fused_flex_attention_backward_1": "attention",
        "triton_red_fused_abs_max_slice_backward_0": "fp8 scaling",
        "triton_red_fused_abs_constant_pad_nd_max_0": "fp8 scaling",
        "triton_red_fused__to_copy_arange_eq_exp_logsumexp_mul_sub_unsqueeze_0": "fused elementwise",
        "triton_tem_fused_0": "attention",
        "triton_red_fused__to_copy_abs_amax_0": "fp8 scaling",
        "triton_poi_fused__to_copy_clamp_mul_1": "fp8 scaling",
        "_float8_cast_kernel": "fp8 scaling",
        "triton_per_fused__to_copy_mean_mul_pow_rsqrt_0": "fused elementwise",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "other",
    }
    assert {n: kernel_kind(n) for n in names} == names
    summary = summarize([(n, 1000.0) for n in names] + [(next(iter(names)), 3000.0)], steps=2)
    assert list(summary["ms_per_step"]) == list(KINDS)
    assert summary["ms_per_step"]["matmul"] == pytest.approx(2.5)
    assert summary["total_ms"] == pytest.approx((len(names) + 3) / 2)
    assert summary["top"][0] == (next(iter(names)), "matmul", 2.0, 1.0)  # 4 ms in 2 launches over 2 steps
    text = format_profile(summary, label="bf16", wall_ms=6.0)
    # a step of a few ms (a decode cycle) is printed to the microsecond, a longer one to 0.1 ms
    assert text.startswith(f"kernel time per step (bf16, 2 profiled steps): {summary['total_ms']:.3f} ms, "
                           "step wall time 6.000 ms")
    long_step = summarize([(n, 20_000.0) for n in names], steps=1)
    assert format_profile(long_step, label="bf16", wall_ms=300.0).startswith(
        f"kernel time per step (bf16, 1 profiled steps): {20.0 * len(names):.1f} ms, step wall time 300.0 ms")
    with pytest.raises(ValueError, match="steps=0"):
        summarize([], steps=0)
    with pytest.raises(ConfigError, match="needs a count >= 0 and a CUDA --device"):
        bd.run_drafter_bench("cpu", steps=1, shape="tiny", profile_steps=1)


def test_cli_shapes_are_the_bench_shapes():
    from dflash_ipc.cli.bench import BENCH_DRAFTER_SHAPES
    assert sorted(BENCH_DRAFTER_SHAPES) == sorted(bd.SHAPES)


def test_small_target_shapes():
    small = bd.drafter_model_config("smollm2-135m")
    assert (small.hidden_size, small.vocab_size, small.num_hidden_layers) == (576, 49152, 3)
    assert (small.num_attention_heads, small.num_key_value_heads, small.head_dim) == (9, 3, 64)
    assert small.intermediate_size == 1536 and small.target_layer_ids == [1, 14, 27]
    mid = bd.drafter_model_config("qwen3-1.7b")
    assert (mid.hidden_size, mid.vocab_size, mid.num_hidden_layers, mid.intermediate_size) == (2048, 151936, 5, 6144)
    assert mid.target_layer_ids == [1, 7, 13, 19, 25]
    with pytest.raises(ConfigError, match="smollm2-135m"):
        bd.drafter_model_config("nope")


def test_compile_specs_make_variants_of_every_precision():
    variants = bd.precision_variants(["bf16", "fp8"], compiles=["off@1.5", "off", "reduce-overhead"])
    assert variants == [{"precision": "bf16", "compile": "off", "lm_head_chunk_gib": 1.5},
                        {"precision": "bf16", "compile": "off"},
                        {"precision": "bf16", "compile": "reduce-overhead"},
                        {"precision": "fp8", "fp8_recipe": "tensorwise", "fp8_lm_head": "all", "compile": "off",
                         "lm_head_chunk_gib": 1.5},
                        {"precision": "fp8", "fp8_recipe": "tensorwise", "fp8_lm_head": "all", "compile": "off"},
                        {"precision": "fp8", "fp8_recipe": "tensorwise", "fp8_lm_head": "all",
                         "compile": "reduce-overhead"}]
    assert [bd.variant_label(v) for v in variants[:3]] == ["bf16, chunks 1.5 GiB", "bf16",
                                                           "bf16, compile reduce-overhead"]
    with pytest.raises(ConfigError, match="mode 'fast' not allowed; allowed: off, default"):
        bd.precision_variants(["bf16"], compiles=["fast"])
    with pytest.raises(ConfigError, match="'x' after '@' is not a number"):
        bd.precision_variants(["bf16"], compiles=["off@x"])


def test_ragged_bench_reports_its_setup_and_compile_counts(capsys, caplog):
    with caplog.at_level(logging.INFO, logger="dflash_ipc.bench.drafter"):
        f = bd.run_drafter_bench("cpu", steps=2, shape="tiny", anchors_per_seq=16, num_seqs=2, seq_len=128, warmup=1,
                                 variant={"precision": "bf16", "compile": "reduce-overhead",
                                          "lm_head_chunk_gib": 1 / 1024}, ragged=True)
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert "step 0 (warmup)" in steps[0] and "256 context tokens" in steps[0]  # the heaviest step first
    report = capsys.readouterr().out
    assert f["compile_mode"] == "reduce-overhead" and not f["compile_active"]  # CPU: eager, said in the log
    assert f["lm_head_chunk_rows"] == (1 << 20) // (512 * 4)
    assert "drafter.compile=reduce-overhead (FELL BACK TO EAGER: None)" not in report
    assert "LM head + CE in chunks of <= 512 rows" in report and "torch.compile warmup" in report
    assert 32 <= f["num_ctx_min"] <= f["num_ctx_max"] <= 256 and "32..128 (ragged)" in report
    assert f["compiles_timed"]["frames"] == 0 and f["timed_steps_compiling"] == []
    assert f["step_s_mean_no_compile"] == pytest.approx(f["step_s_mean"])
