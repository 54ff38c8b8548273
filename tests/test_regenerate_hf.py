"""regenerate with the hf backend on the tiny target: replies are the target's own."""

import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner

from dflash_ipc.builtin.tiny import TINY_VOCAB_WORDS
from dflash_ipc.regenerate.generator import Generator, GeneratorSettings
from dflash_ipc.regenerate.options import GenerationOptions
from dflash_ipc.regenerate.run import regenerate

from regen_helpers import run_hf, write_rows

W = TINY_VOCAB_WORDS


@pytest.fixture(scope="module")
def target(tiny_cache):
    return os.path.join(tiny_cache, "tiny-target")


@pytest.fixture(scope="module")
def model(target):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(target).eval()


@pytest.fixture(scope="module")
def tok(target):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(target)


def user(text):
    return {"role": "user", "content": text}


def run(target, inp, out, *, model=None, **kw):
    backend_kw = {k: kw.pop(k) for k in ("token_budget", "max_batch_size", "cache") if k in kw}
    return run_hf(target, inp, out, GenerationOptions(**{"max_new_tokens": 12, **kw}), model=model, **backend_kw)


def plain_generate(model, tok, messages, max_new_tokens):
    """The reference: transformers generate on one prompt, greedy, no padding."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)
    new = out[0, ids.shape[1]:].tolist()
    return tok.decode(new[:-1] if new and new[-1] == tok.eos_token_id else new)


PROMPTS = [" ".join(W[(7 * i + k) % 1000] for k in range(1 + (5 * i) % 23)) for i in range(12)]


def test_greedy_replies_are_plain_generate_and_do_not_depend_on_batching(target, model, tok, tmp_path):
    inp = write_rows(tmp_path / "in.jsonl", [{"messages": [user(p)]} for p in PROMPTS])
    a = run(target, inp, tmp_path / "a.jsonl", model=model)
    b = run(target, inp, tmp_path / "b.jsonl", model=model, token_budget=60, max_batch_size=3)  # other batches
    c = run(target, inp, tmp_path / "c.jsonl", model=model, cache="static")
    assert a.complete and a.num_written == 12 and a.padding_share > 0
    text = (tmp_path / "a.jsonl").read_text()
    assert (tmp_path / "b.jsonl").read_text() == text and (tmp_path / "c.jsonl").read_text() == text
    rows = [json.loads(line) for line in text.splitlines()]
    assert [r["index"] for r in rows] == list(range(12))
    for r, p in zip(rows, PROMPTS):
        assert r["messages"][0] == user(p)
        assert r["messages"][1] == {"role": "assistant", "content": plain_generate(model, tok, [user(p)], 12)}


def test_a_piped_input_is_read_once_whole(target, model, tmp_path):
    """regenerate peeks at the first row (an empty input is refused before any output): from
    the one reader, so a pipe (`/dev/stdin`) keeps every row."""
    import os
    inp = write_rows(tmp_path / "in.jsonl", [{"messages": [user(p)]} for p in PROMPTS[:3]])
    read_end, write_end = os.pipe()
    os.write(write_end, open(inp, "rb").read())
    os.close(write_end)
    try:
        report = run(target, f"/dev/fd/{read_end}", tmp_path / "piped.jsonl", model=model)
    finally:
        os.close(read_end)
    assert report.complete and report.num_rows == 3 and report.num_written == 3


def test_multi_turn_replaces_every_assistant_turn_and_only_those(target, model, tok, tmp_path):
    source = [{"role": "system", "content": W[900]}, user(W[1]), {"role": "assistant", "content": W[2]},
              user(f"{W[3]} {W[4]}"), {"role": "assistant", "content": W[5]}, user(W[6]),
              {"role": "assistant", "content": W[7]}]
    sharegpt = {"conversations": [{"from": "human", "value": W[8]}, {"from": "gpt", "value": W[9]},
                                  {"from": "human", "value": W[10]}, {"from": "gpt", "value": W[11]}]}
    inp = write_rows(tmp_path / "in.jsonl", [{"messages": source}, sharegpt])
    report = run(target, inp, tmp_path / "o.jsonl", model=model)
    assert report.num_written == 2 and report.num_replies == 5
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    for got, want in zip((rows[0]["messages"], rows[1]["messages"]),
                         (source, [user(W[8]), {"role": "assistant"}, user(W[10]), {"role": "assistant"}])):
        assert [m["role"] for m in got] == [m["role"] for m in want]
        for k, (g, w) in enumerate(zip(got, want)):
            if w["role"] != "assistant":
                assert g == w  # kept as it was
                continue
            # replaced by the target's reply to the regenerated history before it
            assert g["content"] == plain_generate(model, tok, got[:k], 12) and g["content"] != w.get("content")


def test_stop_tokens_end_a_reply_and_max_new_tokens_cuts_it(target, model, tok, tmp_path):
    prompt = tok(tok.apply_chat_template([user(PROMPTS[3])], tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    free = Generator(GeneratorSettings(target, stop_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id), "cpu", model)
    (tokens, stopped), = free.generate([prompt], [10])[0]
    assert not stopped and len(tokens) == 10
    stop = tokens[4]
    # a target whose generation_config names that token as an end of sequence
    other = tmp_path / "target"
    shutil.copytree(target, other)
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, stop]}))
    inp = write_rows(tmp_path / "in.jsonl", [{"messages": [user(PROMPTS[3])]}, {"messages": [user(PROMPTS[5])]}])
    report = run(str(other), inp, tmp_path / "o.jsonl", max_new_tokens=10)  # loaded from there, configs and all
    first = json.loads((tmp_path / "o.jsonl").read_text().splitlines()[0])
    cut = tokens[: tokens.index(stop)]
    assert first["messages"][1]["content"] == tok.decode(cut)  # ends before its stop token
    assert report.num_truncated == report.num_replies - 1  # the other reply ran to --max-new-tokens


def test_sampling_is_seeded(target, model, tmp_path):
    inp = write_rows(tmp_path / "in.jsonl", [{"messages": [user(p)]} for p in PROMPTS[:4]])
    texts = []
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        run(target, inp, tmp_path / f"{name}.jsonl", model=model, temperature=1.0, top_p=0.9, seed=seed)
        texts.append((tmp_path / f"{name}.jsonl").read_text())
    run(target, inp, tmp_path / "g.jsonl", model=model)
    assert texts[0] == texts[1] and texts[0] != texts[2] and texts[0] != (tmp_path / "g.jsonl").read_text()


def test_cli_regenerate_then_prepare_with_rejects_by_index(target, tmp_path):
    from dflash_ipc.cli import main
    from dflash_ipc.data.dataset import TokenDataset

    rows = [{"messages": [user(PROMPTS[0]), {"role": "assistant", "content": "x"}, user(W[3]),
                          {"role": "assistant", "content": "y"}]},
            "{broken", {"messages": [user(f"{W[1]} <|im_start|>")]}, {"conversations": [{"from": "human", "value": W[2]}]}]
    inp = write_rows(tmp_path / "in.jsonl", [r if isinstance(r, dict) else {"broken": True} for r in rows])
    (tmp_path / "in.jsonl").write_text((tmp_path / "in.jsonl").read_text().replace('{"broken": true}', "{broken"))
    runner = CliRunner()
    args = ["regenerate", "--model", target, "--input", inp, "--out", str(tmp_path / "r.jsonl"), "--devices", "cpu",
            "--max-new-tokens", "6", "--max-turns", "1", "--chat-template-kwargs", "enable_thinking=false"]
    res = runner.invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "complete (sorted by index)" in res.output and "2 written, 2 rejected" in res.output
    rejects = [json.loads(line) for line in (tmp_path / "r.rejects.jsonl").read_text().splitlines()]
    assert [(r["index"], r["reason"], r["where"].rsplit(":", 1)[1]) for r in rejects] == [
        (1, "malformed_json", "2"), (2, "special_token_in_content", "3")]
    out = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [r["index"] for r in out] == [0, 3] and len(out[0]["messages"]) == 2  # --max-turns 1
    state = json.loads((tmp_path / "r.state.json").read_text())
    assert state["settings"]["template_kwargs"] == {"enable_thinking": False} and state["complete"]
    again = runner.invoke(main, args, catch_exceptions=False)  # a rerun: nothing left but the rejects
    assert "2 already done, 0 written, 2 rejected" in again.output
    res = runner.invoke(main, ["prepare", "--model", target, "--input", str(tmp_path / "r.jsonl"),
                               "--out", str(tmp_path / "ds")], catch_exceptions=False)
    assert res.exit_code == 0 and "2 samples written" in res.output
    assert len(TokenDataset(str(tmp_path / "ds"))) == 2


def test_ctrl_c_keeps_finished_rows_and_a_rerun_completes(target, model, tmp_path, capsys, caplog):
    from dflash_ipc.regenerate.hf import HFBackend

    inp = write_rows(tmp_path / "in.jsonl", [{"messages": [user(p)]} for p in PROMPTS])
    ref = run(target, inp, tmp_path / "ref.jsonl", model=model)
    options = GenerationOptions(max_new_tokens=12)
    backend = HFBackend(target, options, model=model, max_batch_size=1)  # the engine's batches: 4 x 1 rows
    real, polls = backend.poll, []

    def interrupted(**kw):
        polls.append(1)
        if len(polls) == 3:
            raise KeyboardInterrupt
        return real(**kw)

    backend.poll = interrupted
    with pytest.raises(KeyboardInterrupt):
        regenerate(inp, str(tmp_path / "o.jsonl"), backend, options, progress=True)
    err = capsys.readouterr().err
    text = (tmp_path / "o.jsonl").read_text()
    n = len(text.splitlines())
    assert 0 < n < 12 and text.endswith("\n")  # the rows finished before Ctrl-C, whole
    assert f"partial, {n} rows written ({n} this run), {12 - n} in flight lost" in caplog.text
    line = err.strip().splitlines()[-1]  # the progress line: rows, rates, ETA
    assert line.startswith(f"regenerate: {n}/12 rows (0 before), ") and "rows/s" in line and "tokens/s" in line
    assert "ETA" in line
    assert json.loads((tmp_path / "o.state.json").read_text())["complete"] is False
    again = run(target, inp, tmp_path / "o.jsonl", model=model)
    assert again.complete and again.num_skipped == n and again.num_written == 12 - n
    assert (tmp_path / "o.jsonl").read_bytes() == (tmp_path / "ref.jsonl").read_bytes()
    assert ref.complete


def test_every_input_format_regenerates_alike(target, model, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"messages": [user(p), {"role": "assistant", "content": "x"}]} for p in PROMPTS[:5]]
    write_rows(tmp_path / "in.jsonl", rows)
    (tmp_path / "in.json").write_text(json.dumps(rows, indent=2))
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "in.parquet"))
    outs = []
    for name in ("in.jsonl", "in.json", "in.parquet"):
        assert run(target, str(tmp_path / name), tmp_path / f"{name}.out", model=model).complete
        outs.append((tmp_path / f"{name}.out").read_bytes())
    assert outs[0] == outs[1] == outs[2]


def test_a_reply_gets_what_is_left_of_the_context(target, tmp_path):
    from dflash_ipc.regenerate.hf import HFBackend

    small = tmp_path / "target"
    shutil.copytree(target, small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 40}))
    inp = write_rows(tmp_path / "in.jsonl", [{"messages": [user(" ".join(W[:10]))]}, {"messages": [user(" ".join(W[:50]))]}])
    report = run(str(small), inp, tmp_path / "o.jsonl", max_new_tokens=100)
    assert report.num_written == 1 and report.rejects_by_reason == {"too_long": 1} and report.new_tokens <= 40 - 18
    backend = HFBackend(str(small), GenerationOptions(), devices="cpu")
    assert backend.describe()["model_dir"] == str(small) and backend.max_positions == 40


@pytest.mark.parametrize("decoder", ["engine", "generate"])
def test_out_of_memory_splits_the_batch_and_rejects_only_a_prompt_too_big_alone(target, model, tmp_path, caplog,
                                                                                decoder):
    """A batch that runs out of memory is split in halves until it fits; a prompt that does not
    fit even alone rejects its own row, and every other row gets the reply it gets unsplit."""
    from dflash_ipc.regenerate.hf import HFBackend

    prompts = PROMPTS[:6] + [" ".join(W[:60]), " ".join(W[100:160])]  # two "too long" ones, batched together
    inp = write_rows(tmp_path / "in.jsonl", [{"messages": [user(p)]} for p in prompts])
    ref = run(target, inp, tmp_path / "ref.jsonl", model=model)
    options = GenerationOptions(max_new_tokens=12)
    backend = HFBackend(target, options, model=model, token_budget=1 << 14, decoder=decoder)
    name = "_run_engine" if decoder == "engine" else "_generate"
    real = getattr(backend._local, name)

    def small_gpu(batch, max_new, *keys):  # fits 2 prompts at most, and none longer than 50 tokens
        import sys
        # A retry runs with no exception being handled: its traceback would hold the failed
        # attempt's frames, and on a GPU their tensors.
        assert sys.exc_info()[0] is None
        if len(batch) > 2 or max(map(len, batch)) > 50:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(batch, max_new, *keys)

    setattr(backend._local, name, small_gpu)
    report = regenerate(inp, str(tmp_path / "o.jsonl"), backend, options, progress=False)
    assert report.complete and report.num_written == 6 and report.rejects_by_reason == {"generation_error": 2}
    rejects = [json.loads(line) for line in (tmp_path / "o.rejects.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rejects] == [6, 7] and all("out of memory on its own" in r["detail"] for r in rejects)
    assert "out of memory on a batch of 2" in caplog.text
    kept = [line for line in (tmp_path / "ref.jsonl").read_text().splitlines() if json.loads(line)["index"] < 6]
    assert (tmp_path / "o.jsonl").read_text().splitlines() == kept
    assert ref.num_written == 8


def test_a_batch_that_fails_in_its_device_process_rejects_its_rows(target, model):
    """A device process reports a failed batch with no stats and the error: the rows of that
    batch get the error (rejected), and the backend goes on."""
    from dflash_ipc.regenerate.conversation import Request
    from dflash_ipc.regenerate.hf import HFBackend

    backend = HFBackend(target, GenerationOptions(max_new_tokens=4), model=model)
    request = Request(key=(0, 1), messages=[user(PROMPTS[0])], tools=None, max_new_tokens=4)
    backend.prepare(request)
    backend.submit(request)

    class FailedPool:  # what devices.DevicePool.get returns for a batch whose generate raised
        def free_slots(self):
            return 0

        def get(self, timeout_s):
            return [(0, 1)], None, None, "cuda:1", "RuntimeError: CUDA error: an illegal memory access"

    backend._pool = FailedPool()
    (reply,) = backend.poll(flush=True)
    assert reply.key == (0, 1) and reply.error.startswith("RuntimeError: CUDA error")
    assert backend.pending() == 0 and backend.stats.batches == 0


@pytest.fixture(scope="module")
def vl_target(tmp_path_factory):
    from architectures import ARCHITECTURES, build_tiny_target_of
    return build_tiny_target_of(ARCHITECTURES["qwen3_vl"], str(tmp_path_factory.mktemp("vl") / "t"))


def test_a_multimodal_target_generates_through_its_image_text_class(vl_target):
    # transformers has no causal-LM class for Qwen3-VL: its image-text class generates the text.
    from transformers import AutoModelForImageTextToText
    generator = Generator(GeneratorSettings(vl_target, pad_id=0), "cpu")
    assert type(generator.model).__name__ == "Qwen3VLForConditionalGeneration"
    prompt = list(range(40, 52))
    (tokens, stopped), = generator.generate([prompt], [6])[0]
    reference = AutoModelForImageTextToText.from_pretrained(vl_target).eval()
    with torch.inference_mode():
        out = reference.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=6, min_new_tokens=6, pad_token_id=0)
    assert tokens == out[0, len(prompt):].tolist() and not stopped


def test_a_checkpoint_missing_a_weight_is_refused_with_its_name(tmp_path):
    from dflash_ipc.errors import DataError
    from architectures import ARCHITECTURES, build_tiny_target_of
    from target_helpers import drop_weight
    target = build_tiny_target_of(ARCHITECTURES["qwen3"], str(tmp_path / "t"))
    drop_weight(target, "model.layers.1.mlp.down_proj.weight")
    with pytest.raises(DataError, match=r"1 weights are missing.*model\.layers\.1\.mlp\.down_proj\.weight"):
        Generator(GeneratorSettings(target), "cpu")


def test_samples_per_prompt_are_numbered_lines_that_resume_exactly(target, model, tmp_path):
    """N sampled replies per row from one pass, each line numbered; a sample's reply depends on
    (seed, row, turn, sample) only, so a run resumed from a partial file writes the same lines."""
    from dflash_ipc.errors import ConfigError, DataError

    multi = [user(W[1]), {"role": "assistant", "content": W[2]}, user(W[3])]
    inp = write_rows(tmp_path / "in.jsonl", [{"messages": [user(p)]} for p in PROMPTS[:3]] + [{"messages": multi}])
    opts = {"max_new_tokens": 8, "temperature": 1.0, "seed": 5, "samples_per_prompt": 3}
    report = run(target, inp, tmp_path / "a.jsonl", model=model, **opts)
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert report.complete and report.num_written == 12 and report.num_replies == 3 * 3 + 3 * 2
    # the samples of a prompt share its prefill (the engine's refills take them together)
    assert report.shared_prompts > 0 and f"{report.shared_prompts} replies shared" in report.summary()
    assert [(r["index"], r["sample"]) for r in rows] == [(i, k) for i in range(4) for k in range(3)]
    assert all(lines[i].startswith(f'{{"index": {r["index"]}, "sample": {r["sample"]}, "messages"')
               for i, r in enumerate(rows))
    assert all(len({r["messages"][-1]["content"] for r in rows[3 * i: 3 * i + 3]}) > 1 for i in range(4))
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant", "user", "assistant"] for r in rows[9:])
    # a partial output: row 1 and sample 2 of rows 0 and 2 missing
    dropped = [r["index"] == 1 or (r["sample"] == 2 and r["index"] != 3) for r in rows]
    (tmp_path / "b.jsonl").write_text("".join(line + "\n" for line, drop in zip(lines, dropped) if not drop))
    state = json.loads((tmp_path / "a.state.json").read_text())
    (tmp_path / "b.state.json").write_text(json.dumps(state | {"complete": False}))
    again = run(target, inp, tmp_path / "b.jsonl", model=model, **opts)
    assert again.complete and again.num_skipped == 1 and again.num_written == sum(dropped) == 5
    assert (tmp_path / "b.jsonl").read_text() == (tmp_path / "a.jsonl").read_text()
    with pytest.raises(DataError, match="other settings"):
        run(target, inp, tmp_path / "b.jsonl", model=model, **(opts | {"samples_per_prompt": 2}))
    with pytest.raises(ConfigError, match="--samples-per-prompt"):
        GenerationOptions(samples_per_prompt=2)


def test_the_decoder_is_the_engine_where_the_target_allows(target, model, vl_target):
    from dflash_ipc.errors import ConfigError
    from dflash_ipc.regenerate.hf import HFBackend

    assert HFBackend(target, GenerationOptions(), model=model).decoder == "engine"
    assert HFBackend(target, GenerationOptions(), model=model, decoder="generate").decoder == "generate"
    assert Generator(GeneratorSettings(vl_target, pad_id=0), "cpu").decoder == "generate"  # multimodal
    with pytest.raises(ConfigError, match="--decoder engine: .* multimodal"):
        Generator(GeneratorSettings(vl_target, pad_id=0, decoder="engine"), "cpu")


def test_rows_default_to_the_decoder_and_device_and_a_named_size_wins(target, model):
    from dflash_ipc.regenerate.generator import default_max_batch_size
    from dflash_ipc.regenerate.hf import HFBackend

    assert HFBackend(target, GenerationOptions(), model=model).settings.max_rows == 64  # CPU
    assert HFBackend(target, GenerationOptions(), model=model, max_batch_size=3).settings.max_rows == 3
    # on a GPU the engine holds more rows than a generate call holds prompts (docs/benchmarks.md)
    assert default_max_batch_size("engine", cpu=False) == 512
    assert default_max_batch_size("generate", cpu=False) == 256
    assert default_max_batch_size("engine", cpu=True) == default_max_batch_size("generate", cpu=True) == 64


def test_a_tool_row_the_template_cannot_render_is_rejected_not_regenerated_without_its_tools(target, model):
    """The tiny target's ChatML template renders content only: a prompt with a tool schema and a
    tool call would reach the target as plain text without them."""
    from dflash_ipc.data.messages import RowRejected
    from dflash_ipc.regenerate.conversation import Request
    from dflash_ipc.regenerate.hf import HFBackend

    backend = HFBackend(target, GenerationOptions(max_new_tokens=4), model=model)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    request = Request(key=(0, 1), messages=[user(PROMPTS[0])], tools=tools, max_new_tokens=4)
    with pytest.raises(RowRejected) as e:
        backend.prepare(request)
    assert e.value.reason == "tools_not_rendered" and "tool 'lookup' is named 1 times" in e.value.detail
    backend.prepare(Request(key=(1, 1), messages=[user(PROMPTS[0])], tools=None, max_new_tokens=4))
