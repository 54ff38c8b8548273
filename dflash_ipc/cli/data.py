"""`prepare` (chat data -> a memory-mapped dataset) and `regenerate` (the target writes the replies)."""

from __future__ import annotations


import click

from dflash_ipc.config.schema import DTYPE_NAMES
from dflash_ipc.cli.app import echo_report, input_option, main, max_line_option, split_option, template_kwargs_option



@main.command()
@click.option("--model", "model_dir", required=True, type=click.Path(file_okay=False),
              help="Target model directory or Hub id ORG/NAME (its tokenizer and chat template are used).")
@input_option
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Output dataset directory.")
@split_option
@click.option("--max-length", default=4096, show_default=True, help="Longest sample in tokens.")
@click.option("--on-long", type=click.Choice(["truncate", "reject"]), default="truncate", show_default=True)
@click.option("--last-turn-only", is_flag=True, help="Loss on the last assistant turn only.")
@template_kwargs_option
@click.option("--held-out", type=click.IntRange(min=0), default=0, show_default=True,
              help="Keep the last N usable conversations out of the dataset; their prompts are recorded for eval.")
@click.option("--dedup", is_flag=True, help="Drop samples with the same tokens as an earlier one (always counted).")
@max_line_option
@click.option("--workers", "num_workers", default=1, show_default=True, help="Tokenizer processes.")
@click.option("--strict", is_flag=True, help="Stop at the first bad row.")
@click.option("--overwrite", is_flag=True, help="Replace an existing dataset at --out.")
def prepare(model_dir, input_path, out_dir, split, max_length, on_long, last_turn_only, template_kwargs, held_out,
            dedup, max_line_bytes, num_workers, strict, overwrite) -> None:
    """Tokenize chat data into a memory-mapped training dataset."""
    from dflash_ipc.data.messages import parse_template_kwargs
    from dflash_ipc.data.prepare import prepare_dataset
    from dflash_ipc.hf.hub import resolve_dataset, resolve_model
    model_dir = resolve_model(model_dir, what="--model")
    input_path = resolve_dataset(input_path, what="--input")
    report = prepare_dataset(model_dir, input_path, out_dir, max_length=max_length, last_turn_only=last_turn_only,
                             num_workers=num_workers, strict=strict, on_long=on_long, overwrite=overwrite,
                             split=split, max_line_bytes=max_line_bytes, held_out=held_out, dedup=dedup,
                             template_kwargs=parse_template_kwargs(template_kwargs))
    echo_report(report)


@main.command()
@click.option("--model", "model_dir", default=None, type=click.Path(file_okay=False),
              help="Target model directory or Hub id ORG/NAME (hf backend).")
@input_option
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False), help="Output JSONL file.")
@split_option
@click.option("--backend", "kind", type=click.Choice(["hf", "openai"]), default="hf", show_default=True)
@click.option("--max-new-tokens", default=2048, show_default=True, help="Longest reply in tokens.")
@click.option("--temperature", default=0.0, show_default=True, help="0: greedy.")
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=0, show_default=True, help="0: no limit.")
@click.option("--seed", default=0, show_default=True)
@click.option("--max-turns", type=click.IntRange(min=1), default=None, help="Assistant turns to regenerate per row.")
@template_kwargs_option
@click.option("--reasoning", type=click.Choice(["keep", "drop"]), default="keep", show_default=True,
              help="A reply's <think> reasoning: kept as reasoning_content, or dropped.")
@click.option("--devices", default="auto", show_default=True,
              help="hf: cpu, cuda:0 or cuda:0,cuda:1,... (one process per device); auto: every GPU, else cpu.")
@click.option("--dtype", type=click.Choice(["auto", *DTYPE_NAMES]), default="auto",
              show_default=True, help="hf: auto = bfloat16 on GPU, float32 on CPU.")
@click.option("--decoder", type=click.Choice(["auto", "engine", "generate"]), default="auto", show_default=True,
              help="hf: engine = static row cache, continuous batching, token choice on the device; "
                   "generate = transformers' generate per batch; auto: engine where the target allows.")
@click.option("--samples-per-prompt", type=click.IntRange(min=1), default=1, show_default=True,
              help="Sampled replies per conversation (needs --temperature > 0); each an output line with its "
                   "\"sample\" number.")
@click.option("--cache", type=click.Choice(["auto", "static", "dynamic"]), default="auto", show_default=True,
              help="hf, generate decoder: KV cache (auto: static on GPU, dynamic on CPU).")
@click.option("--token-budget", type=click.IntRange(min=1), default=None,
              help="hf: cached positions in all (engine: rows x (longest prompt + max new tokens), default 16384 "
                   "on CPU, 60% of the GPU memory left by the model; generate: per batch, default 131072 GPU, "
                   "16384 CPU).")
@click.option("--max-batch-size", type=click.IntRange(min=1), default=None,
              help="hf: rows in flight (engine; default 512 GPU) or prompts per batch (generate; default 256 "
                   "GPU); 64 on CPU.")
@click.option("--url", default=None, help="openai: the server's base URL, e.g. http://127.0.0.1:8000/v1.")
@click.option("--served-model", default=None, help="openai: model name (default: the first the server lists).")
@click.option("--concurrency", default=16, show_default=True, help="openai: requests in flight at most.")
@click.option("--timeout-s", default=600.0, show_default=True,
              help="openai: seconds per request, the whole request (headers and body) included.")
@click.option("--retries", default=5, show_default=True, help="openai: retries of a failed request.")
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None, help="openai: bearer token (env OPENAI_API_KEY).")
@click.option("--max-answer-mib", type=click.FloatRange(min=0, min_open=True), default=16.0, show_default=True,
              help="openai: an answer larger than this is refused unread (its row rejected).")
@click.option("--window", default=4096, show_default=True, help="Rows in flight at most.")
@max_line_option
@click.option("--overwrite", is_flag=True, help="Start over instead of resuming an existing --out.")
def regenerate(model_dir, input_path, out_path, split, kind, max_new_tokens, temperature, top_p, top_k, seed,
               max_turns, template_kwargs, reasoning, devices, dtype, decoder, samples_per_prompt, cache, token_budget,
               max_batch_size, url, served_model, concurrency, timeout_s, retries, api_key, max_answer_mib, window,
               max_line_bytes, overwrite) -> None:
    """Replace every assistant turn with the target's own reply (resumable: rerun to continue)."""
    from dflash_ipc.data.messages import parse_template_kwargs
    from dflash_ipc.run.logs import setup_logging
    from dflash_ipc.regenerate.options import GenerationOptions
    from dflash_ipc.regenerate.run import (auto_devices, check_backend_options, make_backend,
                                           regenerate as run_regenerate)
    setup_logging("regenerate")
    if kind == "hf" and model_dir is not None:
        from dflash_ipc.data.prepare import check_model_dir
        from dflash_ipc.hf.hub import resolve_model
        # A Hub id becomes its snapshot directory first; a path that is none is answered
        # before --devices auto and the backend import torch (seconds).
        model_dir = resolve_model(model_dir, what="--model")
        check_model_dir(model_dir)
    options = GenerationOptions(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, max_turns=max_turns, reasoning=reasoning,
                                template_kwargs=parse_template_kwargs(template_kwargs),
                                samples_per_prompt=samples_per_prompt)
    from dflash_ipc.regenerate.out_paths import check_out_path, local_input_files
    # An --out that is a device or one of the inputs is answered before the model loads (and
    # before --overwrite deletes anything); RegenOutput checks again with a Hub input resolved.
    check_out_path(out_path, local_input_files(input_path, split), input_dir=input_path, split=split)
    from dflash_ipc.regenerate.out_lock import OutLock
    from dflash_ipc.regenerate.output import check_writable
    check_writable(out_path)
    # Held from here, before the model loads: a second run on this --out is refused at once,
    # and two started together cannot both load a model and then meet (regenerate/out_lock.py).
    lock = OutLock(out_path)
    lock.acquire()
    try:
        if not overwrite:  # another option than the output's is answered before the model loads
            from dflash_ipc.regenerate.output import check_resumable
            check_backend_options(kind, model_dir=model_dir, url=url)  # a missing --model or --url first
            check_resumable(out_path, {**options.settings(), "backend": kind, "split": split})
        backend = make_backend(kind, options, model_dir=model_dir, devices=auto_devices(devices), dtype=dtype,
                               decoder=decoder, cache=cache, token_budget=token_budget, max_batch_size=max_batch_size,
                               url=url, served_model=served_model, concurrency=concurrency, timeout_s=timeout_s,
                               retries=retries, api_key=api_key, max_answer_mib=max_answer_mib)
        try:
            report = run_regenerate(input_path, out_path, backend, options, split=split,
                                    max_line_bytes=max_line_bytes, window=window, overwrite=overwrite, lock=lock)
        finally:
            backend.close()
    finally:
        lock.release()  # the output has let it go already, unless the run failed before it took it
    echo_report(report)
