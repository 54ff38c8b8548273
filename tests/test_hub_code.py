"""`dflash-ipc export --with-code`: the directory loads through `AutoModel.from_pretrained(...,
trust_remote_code=True)` in plain transformers, computes what the trainer's drafter computes,
and its `spec_generate` gives `dflash-ipc eval`'s tokens and tau."""

import sys

import pytest
import torch
import transformers.dynamic_module_utils as dynamic_modules
from click.testing import CliRunner
from transformers import AutoModel, AutoModelForCausalLM

from dflash_ipc.cli import main
from dflash_ipc.drafter.attention import BlockLayout, build_layer_masks
from dflash_ipc.drafter.inference_format import save_inference_checkpoint
from dflash_ipc.export.hub_code import add_hub_code
from test_drafter_export import tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def hf_modules_cache(tmp_path_factory):
    """transformers copies remote code under HF_MODULES_CACHE (default ~/.cache): here, a temp
    directory, one for the module (its package path is cached once imported)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dynamic_modules, "HF_MODULES_CACHE", str(tmp_path_factory.mktemp("hf-modules")))
        mp.setattr(sys, "path", list(sys.path))
        yield


def _one_block(model, features, embeds):
    """The trainer's drafter on one block at anchor s = len(features), as eval drafts it."""
    s, bs = features.shape[0], embeds.shape[0]
    zeros = torch.zeros(bs, dtype=torch.int32)
    layout = BlockLayout(query_seq=zeros, query_anchor=zeros + s, query_block=zeros,
                         ctx_seq=torch.zeros(s, dtype=torch.int32), ctx_pos=torch.arange(s, dtype=torch.int32),
                         cu_seqlens=torch.tensor([0, s], dtype=torch.int32), block_size=bs)
    masks = build_layer_masks(layout, "dense", model.config.layer_types, model.config.sliding_window)
    return model(features, torch.arange(s), embeds, torch.arange(s, s + bs), masks)


LAYERS = {"full": {}, "sliding": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5},
          "all-sliding": {"layer_types": ["sliding_attention"] * 2, "sliding_window": 3}}


@pytest.mark.parametrize("layers", list(LAYERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hub_model_loads_and_matches_the_trainer_drafter_exactly(tmp_path, dtype, layers):
    kinds = LAYERS[layers]
    model = tiny_model(seed=4, **kinds).eval()  # linear RoPE scaling, norms away from 1
    out = tmp_path / "export"
    save_inference_checkpoint(model, str(out), dtype=dtype, extras=add_hub_code)
    hub = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=dtype).eval()
    assert type(hub).__name__ == "DFlashDraftModel" and type(hub).__module__.endswith("modeling_dflash")
    reference = model.to(dtype)
    assert set(hub.state_dict()) == set(reference.state_dict())
    assert all(torch.equal(hub.state_dict()[k], v) for k, v in reference.state_dict().items())
    assert (hub.block_size, hub.mask_token_id, hub.target_layer_ids) == (4, 60, [0, 2])
    gen = torch.Generator().manual_seed(0)
    for s in (1, 7, 30):
        features = torch.randn(s, 2 * 32, generator=gen).to(dtype)
        embeds = torch.randn(4, 32, generator=gen).to(dtype)
        with torch.no_grad():
            torch.testing.assert_close(hub(features, embeds), _one_block(reference, features, embeds), rtol=0, atol=0)


def test_a_sliding_window_export_generates_losslessly_through_the_model_card_path(tiny_cache, tmp_path):
    """The model card's transformers path on an export with a sliding layer (window 6 < the
    block of 8 and the prompts): spec_generate's tokens are the target's own greedy ones,
    and its blocks are what the trainer's drafter drafts (eval's unbatched proposer)."""
    import os

    from eval_helpers import random_drafter, reference_greedy
    from dflash_ipc.eval.unbatched import DFlashProposer, TargetLM, speculative_generate
    target_dir = os.path.join(tiny_cache, "tiny-target")
    model = random_drafter(target_dir, seed=2, block_size=8, layer_types=["sliding_attention", "full_attention"],
                           sliding_window=6)
    out = tmp_path / "export"
    save_inference_checkpoint(model, str(out), dtype=torch.float32, extras=add_hub_code)
    draft = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    assert [layer.self_attn.window for layer in draft.layers] == [6, None]
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    legacy = TargetLM(target_dir, layer_ids=model.config.target_layer_ids, device="cpu", dtype="float32")
    proposer = DFlashProposer(model, legacy.head)
    gen = torch.Generator().manual_seed(5)
    for n in (3, 17):
        prompt = torch.randint(10, 1000, (n,), generator=gen)
        ids, stats = draft.spec_generate(target, prompt[None], max_new_tokens=20,
                                         stop_token_ids=sorted(legacy.stop_token_ids), return_stats=True)
        assert ids[0, n:].tolist() == reference_greedy(legacy, prompt, 20)
        reference = speculative_generate(legacy, proposer, prompt, max_new_tokens=20)
        assert len(stats["acceptance_lengths"]) == reference.stats.num_cycles
        assert sum(stats["acceptance_lengths"]) == reference.stats.num_committed


def test_spec_generate_refuses_sampling(tmp_path):
    out = tmp_path / "export"
    save_inference_checkpoint(tiny_model(), str(out), dtype=torch.float32, extras=add_hub_code)
    hub = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32)
    with pytest.raises(ValueError, match="greedily only"):
        hub.spec_generate(None, torch.tensor([[1, 2]]), max_new_tokens=4, temperature=0.7)


@pytest.mark.slow
def test_with_code_export_of_a_real_run_matches_eval(cpu_run, tmp_path):
    """The drafter a real CPU job trained, exported with --with-code, decodes the held-out
    prompts in plain transformers exactly as `dflash-ipc eval` did: same tokens, same tau."""
    from dflash_ipc.data.dataset import TokenDataset
    from dflash_ipc.eval.speculative import evaluate, held_out_prompts, stop_token_ids
    out = tmp_path / "export"
    result = CliRunner().invoke(main, ["export", f"{cpu_run.run_dir}/checkpoints", str(out), "--with-code"])
    assert result.exit_code == 0, result.output
    draft = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(cpu_run.target_dir, dtype=torch.float32).eval()
    saved = cpu_run.eval_json[0]  # what `dflash-ipc eval --json --save-to` printed
    report = evaluate(cpu_run.target_dir, str(out), cpu_run.data_dir, num_prompts=saved["num_prompts"],
                      max_new_tokens=saved["max_new_tokens"], dtype="float32")
    prompts = held_out_prompts(TokenDataset(cpu_run.data_dir), num_prompts=saved["num_prompts"])
    stops = stop_token_ids(cpu_run.target_dir, target)  # eval's: the configs' and the tokenizer's
    committed = cycles = 0
    for (sample_id, prompt), sample in zip(prompts, report.samples, strict=True):
        assert sample.sample_id == sample_id
        ids, stats = draft.spec_generate(target, torch.as_tensor(prompt)[None], max_new_tokens=saved["max_new_tokens"],
                                         stop_token_ids=sorted(stops), return_stats=True)
        assert ids[0, :len(prompt)].tolist() == list(prompt)
        assert ids[0, len(prompt):].tolist() == sample.output_ids
        assert len(stats["acceptance_lengths"]) == sample.stats.num_cycles
        if sample.stats.num_cycles:
            assert stats["tau"] == pytest.approx(sample.stats.tau)
        committed += sum(stats["acceptance_lengths"])
        cycles += len(stats["acceptance_lengths"])
    assert committed / cycles == pytest.approx(report.tau) == pytest.approx(saved["tau"])
    # The model card's snippet: a chat template's BatchEncoding (transformers 5) goes in as is.
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(cpu_run.target_dir)
    encoded = tok.apply_chat_template([{"role": "user", "content": "the cat"}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
    by_tensor = draft.spec_generate(target, encoded["input_ids"], max_new_tokens=8)
    assert torch.equal(draft.spec_generate(target, encoded, max_new_tokens=8), by_tensor)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_spec_generate_matches_eval_on_gpu_in_bfloat16(tiny_cache, tmp_path, monkeypatch):
    """The same comparison on a GPU in bf16 (eval's dtype there). The trainer's drafter fuses its
    norms with torch.compile on CUDA; eager here, so both sides run the same ops."""
    import os
    monkeypatch.setenv("DFLASH_COMPILE", "0")

    from transformers import AutoConfig, AutoTokenizer

    from dflash_ipc.drafter.model import DFlashConfig, DFlashDraftModel
    from dflash_ipc.eval.unbatched import DFlashProposer, TargetLM, speculative_generate
    target_dir = os.path.join(tiny_cache, "tiny-target")
    config = DFlashConfig.from_target_config(AutoConfig.from_pretrained(target_dir), num_draft_layers=2,
                                             mask_token_id=AutoTokenizer.from_pretrained(target_dir).mask_token_id,
                                             target_layer_ids=[1, 2])
    torch.manual_seed(0)
    out = tmp_path / "export"
    save_inference_checkpoint(DFlashDraftModel(config), str(out), extras=add_hub_code)  # bf16, as exported
    target = TargetLM(target_dir, layer_ids=[1, 2], device="cuda:0", dtype="bfloat16")
    proposer = DFlashProposer(load_for_eval(out), target.head)
    draft = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.bfloat16).to("cuda:0").eval()
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        prompt = torch.randint(0, config.vocab_size, (int(torch.randint(8, 40, (1,), generator=gen)),), generator=gen)
        reference = speculative_generate(target, proposer, prompt, max_new_tokens=48)
        ids, stats = draft.spec_generate(target.model, prompt[None].cuda(), max_new_tokens=48,
                                         stop_token_ids=sorted(target.stop_token_ids), return_stats=True)
        assert ids[0, len(prompt):].tolist() == reference.output_ids
        assert len(stats["acceptance_lengths"]) == reference.stats.num_cycles
        assert sum(stats["acceptance_lengths"]) == reference.stats.num_committed


def load_for_eval(export_dir):
    from dflash_ipc.eval.speculative import load_drafter
    return load_drafter(str(export_dir), device="cuda:0", dtype=torch.bfloat16)[0]
