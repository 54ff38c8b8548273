"""Random-weight targets of real shapes and random token datasets, for GPU benchmarks.

No weights can be downloaded where benchmarks run, so a "Qwen3-1.7B-shaped" target is a
Qwen3 config of that shape with random weights, saved with `save_pretrained` and loaded back
through the real `from_pretrained` path. Its tokenizer is the tiny local one (the dataset's
ids stay below its vocabulary, the embedding may be larger). The dataset goes through the
real `prepare` path in its pre-tokenized form.

    python -m dflash_ipc.bench.assets target /tmp/qwen3-1.7b --shape qwen3-1.7b
    python -m dflash_ipc.bench.assets target /tmp/moe --shape qwen3-30b-a3b --num-layers 12
    python -m dflash_ipc.bench.assets target /tmp/qwen3-32b --shape qwen3-32b
    python -m dflash_ipc.bench.assets data /tmp/qwen3-1.7b /tmp/data --samples 4000 --min-len 256 --max-len 2048

`--num-layers` builds fewer decoder layers than the shape has (a Qwen3-30B-A3B-shaped target is
61 GB in bf16 at its 48 layers); `dflash_bench.json` in the target directory records the shape's
own depth, so `dflash-ipc bench target` can scale a measured rate to it.
"""

from __future__ import annotations

import json
import math
import os

import click
import numpy as np
import torch

from dflash_ipc.config.dtypes import torch_dtype

_QWEN3_VOCAB = {"vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1e6,
                "tie_word_embeddings": False}
SHAPES: dict[str, tuple[str, dict]] = {
    # name: (transformers config class, its fields)
    "tiny": ("Qwen3Config", dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16, intermediate_size=128, vocab_size=2048,
                                 max_position_embeddings=40960, tie_word_embeddings=False)),  # CPU tests of the bench
    "tiny-moe": ("Qwen3MoeConfig", dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                        vocab_size=2048, max_position_embeddings=40960, tie_word_embeddings=False)),
    "qwen3-0.6b": ("Qwen3Config", dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                                       num_key_value_heads=8, head_dim=128, intermediate_size=3072, **_QWEN3_VOCAB)),
    "qwen3-1.7b": ("Qwen3Config", dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                                       num_key_value_heads=8, head_dim=128, intermediate_size=6144, **_QWEN3_VOCAB)),
    "qwen3-8b": ("Qwen3Config", dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                                     num_key_value_heads=8, head_dim=128, intermediate_size=12288, **_QWEN3_VOCAB)),
    # Qwen3-32B: 65.5 GB in bf16; the target of the tensor-parallel (target.gpus_per_worker) benchmarks.
    "qwen3-32b": ("Qwen3Config", dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
                                      num_key_value_heads=8, head_dim=128, intermediate_size=25600, **_QWEN3_VOCAB)),
    # Qwen3-30B-A3B / Qwen3-Coder-30B-A3B: 128 experts, 8 active, 768-wide experts.
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                                             num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                                             moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                             norm_topk_prob=True, **_QWEN3_VOCAB)),
}
BENCH_FILE = "dflash_bench.json"  # in a built target: its shape and the shape's own depth


def build_random_target(out_dir: str, *, shape: str, dtype: str = "bfloat16", seed: int = 0,
                        num_layers: int | None = None, text_only: bool = False,
                        logit_std: float | None = None) -> str:
    """A random-weight target of `shape` (`num_layers`: fewer decoder layers than the shape's).
    ``text_only``: zero the LM-head rows of ids the tokenizer cannot write, as the tiny target
    does (data/tiny.py), so the target's greedy replies are text (data/synthetic.py).
    ``logit_std``: rescale the LM-head rows of the ids it can write so that a hidden state of
    unit RMS (what the final norm gives) has logits of this spread (see `_sharpen_head`)."""
    import transformers
    from transformers import AutoModelForCausalLM

    from dflash_ipc.builtin.tiny import build_tiny_tokenizer, write_random_model
    config_class, fields = SHAPES[shape]
    depth = fields["num_hidden_layers"]
    if num_layers is not None and not 1 <= num_layers <= depth:
        raise click.BadParameter(f"--num-layers {num_layers}: the shape {shape} has 1..{depth} layers")
    config = getattr(transformers, config_class)(**{**fields, "num_hidden_layers": num_layers or depth})
    tokenizer = build_tiny_tokenizer()

    def build():
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))
        if logit_std is not None:
            _sharpen_head(model, len(tokenizer), logit_std)
        return model
    model = write_random_model(out_dir, build, tokenizer, seed=seed, text_only=text_only)
    with open(os.path.join(out_dir, BENCH_FILE), "w") as f:
        json.dump({"shape": shape, "num_hidden_layers": num_layers or depth, "shape_num_hidden_layers": depth,
                   "num_parameters": model.num_parameters(), "logit_std": logit_std}, f)
    return out_dir


def _sharpen_head(model, num_tokens: int, logit_std: float) -> None:
    """Scale LM-head rows ``[:num_tokens]`` so a unit-RMS hidden state has logits of std
    ``logit_std``. At the default init (std 0.02) a hidden size of 2048 gives logits of std
    ~0.9: a near-flat distribution, in which even the target's own cross-entropy on its greedy
    token is ~9 nats (1,009 such logits beside 150,927 zeros), so a drafter's loss can fall
    only from ~11.9 to ~9. At std 4 that floor is ~1.2 nats: the loss has room to fall."""
    if logit_std <= 0:
        raise click.BadParameter(f"logit_std={logit_std} must be > 0")
    head = model.get_output_embeddings().weight
    if head is model.get_input_embeddings().weight:
        raise click.BadParameter("logit_std: the shape ties its LM head to its embeddings")
    with torch.no_grad():
        rows = head[:num_tokens]
        rows.mul_(logit_std / (rows.float().std() * head.shape[1] ** 0.5).clamp_min(1e-12))


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
@click.option("--num-layers", type=int, default=None, help="Fewer decoder layers than the shape has.")
def _target(out_dir, shape, num_layers) -> None:
    click.echo(build_random_target(out_dir, shape=shape, num_layers=num_layers))


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
