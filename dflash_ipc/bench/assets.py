"""Random-weight targets of real shapes and random token datasets, for GPU benchmarks.

No weights can be downloaded where benchmarks run, so a "Qwen3-1.7B-shaped" target is a
Qwen3 config of that shape with random weights, saved with `save_pretrained` and loaded back
through the real `from_pretrained` path. Its tokenizer is the tiny local one (the dataset's
ids stay below its vocabulary, the embedding may be larger). The dataset goes through the
real `prepare` path in its pre-tokenized form.

    python -m dflash_ipc.bench.assets target /tmp/qwen3-1.7b --shape qwen3-1.7b
    python -m dflash_ipc.bench.assets data /tmp/qwen3-1.7b /tmp/data --samples 4000 --min-len 256 --max-len 2048
"""

from __future__ import annotations

import json
import math

import click
import numpy as np
import torch

SHAPES = {
    # name: (hidden, layers, heads, kv heads, head dim, intermediate, vocab)
    "tiny": (64, 4, 4, 2, 16, 128, 2048),  # for CPU tests of the bench path
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072, 151936),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144, 151936),
    "qwen3-8b": (4096, 36, 32, 8, 128, 12288, 151936),
}


def build_random_target(out_dir: str, *, shape: str, dtype: str = "bfloat16", seed: int = 0,
                        text_only: bool = False) -> str:
    """``text_only``: zero the LM-head rows of ids the tokenizer cannot write, as the tiny
    target does (data/tiny.py), so the target's greedy replies are text (data/synthetic.py)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dflash_ipc.data.tiny import _silence_padding_rows, build_tiny_tokenizer
    hidden, layers, heads, kv, head_dim, inter, vocab = SHAPES[shape]
    config = Qwen3Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, head_dim=head_dim, intermediate_size=inter,
                         vocab_size=vocab, max_position_embeddings=40960, rope_theta=1e6,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    tokenizer = build_tiny_tokenizer()
    if text_only:
        _silence_padding_rows(model, len(tokenizer))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def build_random_dataset(target_dir: str, out_dir: str, *, num_samples: int, min_len: int, max_len: int,
                         seed: int = 0) -> str:
    """Log-uniform lengths in [min_len, max_len]; the second half of each sample is trained."""
    from dflash_ipc.data.prepare import prepare_dataset
    rng = np.random.default_rng(seed)
    jsonl = out_dir.rstrip("/") + ".jsonl"
    with open(jsonl, "w") as f:
        for _ in range(num_samples):
            length = int(math.exp(rng.uniform(math.log(min_len), math.log(max_len))))
            ids = rng.integers(10, 1000, size=length).tolist()
            mask = [0] * (length // 2) + [1] * (length - length // 2)
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
    prepare_dataset(target_dir, jsonl, out_dir, max_length=max_len, progress=False, overwrite=True)
    return out_dir


@click.group()
def main() -> None:
    """Build benchmark assets."""


@main.command("target")
@click.argument("out_dir")
@click.option("--shape", type=click.Choice(sorted(SHAPES)), default="qwen3-1.7b")
def _target(out_dir, shape) -> None:
    click.echo(build_random_target(out_dir, shape=shape))


@main.command("data")
@click.argument("target_dir")
@click.argument("out_dir")
@click.option("--samples", default=4000)
@click.option("--min-len", default=256)
@click.option("--max-len", default=2048)
def _data(target_dir, out_dir, samples, min_len, max_len) -> None:
    click.echo(build_random_dataset(target_dir, out_dir, num_samples=samples, min_len=min_len, max_len=max_len))


if __name__ == "__main__":
    main()
