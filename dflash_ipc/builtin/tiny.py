"""The tiny local target: a word-level tokenizer with a Qwen-style chat template and a
randomly initialised 4-layer Qwen3, both built on this machine from code.

Why: tests and the embedded default need a real HF causal LM and a real tokenizer with a
chat template, without network access or downloaded weights. Everything here is
deterministic (fixed word list, fixed seed), so two builds give the same tokenizer (same
fingerprint) and, on the same torch version, the same weights.

Tokenizer: `tokenizers` WordLevel over `TINY_VOCAB_WORDS` plus the role words, a newline
token and the special tokens below. Spaces separate words and are dropped; each newline is
its own token, so the ChatML newlines exist as tokens exactly like in Qwen's tokenizer.
Unknown words map to `<|unk|>`. Decoding joins tokens with spaces, and re-encoding the
decoded text gives the same ids (the synthetic dataset relies on that round trip).

Usage:
    tok = build_tiny_tokenizer()
    target_dir = build_tiny_target("runs/cache/tiny-target")   # builds once, then reuses
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil

from dflash_ipc.errors import ConfigError, DataError

log = logging.getLogger(__name__)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|mask|>"
UNK = "<|unk|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, MASK, UNK)
ROLE_WORDS = ("system", "user", "assistant")
NEWLINE = "\n"

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_NUM_WORDS = 1000


def _make_words() -> tuple[str, ...]:
    """1000 distinct two-syllable pseudo-words, picked by a fixed stride (no RNG, so the
    list cannot change with the Python version)."""
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]  # 70
    pairs = [a + b for a in syllables for b in syllables]  # 4900
    step = len(pairs) / _NUM_WORDS
    return tuple(pairs[int(i * step)] for i in range(_NUM_WORDS))


TINY_VOCAB_WORDS: tuple[str, ...] = _make_words()
"""The content words of the tiny vocabulary (role words and special tokens excluded)."""

# Same shape as Qwen2.5/Qwen3's ChatML template (system/user/assistant turns, generation
# prompt), without tools and thinking blocks.
TINY_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The same rendered text, with HF generation markers around what the assistant produces
# (its content and <|im_end|>, not the newline the template adds after it).
TINY_CHAT_TEMPLATE_WITH_MARKERS = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# HF's default. Chosen by measuring what a drafter learns (an in-process copy of the
# embedded default's training, 90 steps of 3 x 128 anchors, 2-layer drafter, tau on 8
# held-out prompts, data = this target's own unrestricted greedy replies): tau 1.66 at
# 0.02, 1.25 at 0.05, 1.00 at 0.15 (the untrained drafter: 1.00-1.01). At 0.02
# the residual stream is dominated by the token embeddings, so the greedy next token
# depends mostly on the last two tokens and continuations settle into cycles of varying
# length and content, as greedy decoding of small models tends to; at 0.15 the target is
# chaotic and no drafter of this size learns it in minutes.
TINY_INITIALIZER_RANGE = 0.02

_COMPLETE_MARKER = "dflash_tiny.json"
_TINY_FORMAT = 2  # 2: padding rows of the LM head are zero


def build_tiny_tokenizer(*, with_generation_markers: bool = False):
    """Build the tiny tokenizer (a `PreTrainedTokenizerFast`) with its chat template.

    with_generation_markers: use the template variant with `{% generation %}` markers;
    the rendered text is identical, only the loss-mask method changes.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = list(SPECIAL_TOKENS) + [NEWLINE] + list(ROLE_WORDS) + list(TINY_VOCAB_WORDS)
    vocab = {w: i for i, w in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # Drop spaces (and other non-newline whitespace), keep each newline as a token.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[^\S\n]+"), behavior="removed"),
            pre_tokenizers.Split(NEWLINE, behavior="isolated"),
        ]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        mask_token=MASK,
        unk_token=UNK,
        additional_special_tokens=[IM_START],
    )
    tokenizer.chat_template = (
        TINY_CHAT_TEMPLATE_WITH_MARKERS if with_generation_markers else TINY_CHAT_TEMPLATE
    )
    return tokenizer


def tiny_vocab_size(tokenizer) -> int:
    """Model vocabulary: the tokenizer size rounded up to a multiple of 64 (as real
    targets pad their embedding tables)."""
    return -(-len(tokenizer) // 64) * 64


def _build_params(num_layers: int, hidden_size: int, seed: int) -> dict:
    return {
        "format": _TINY_FORMAT,
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "seed": seed,
        "initializer_range": TINY_INITIALIZER_RANGE,
    }


def tiny_target_key(*, num_layers: int = 4, hidden_size: int = 128, seed: int = 0) -> str:
    """Short hash of everything a tiny target build depends on (its parameters, the code's
    format version and initializer range): the cache directory name of the built-in target,
    so a cache built by other code is never reused."""
    params = _build_params(num_layers, hidden_size, seed)
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]


def _read_complete(out_dir: str) -> dict | None:
    """The build parameters of a complete tiny target in out_dir, or None."""
    try:
        with open(os.path.join(out_dir, _COMPLETE_MARKER)) as f:
            return json.load(f)
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def _tiny_config(tokenizer, num_layers: int, hidden_size: int):
    from transformers import Qwen3Config

    if hidden_size % 4 != 0 or hidden_size < 4:
        raise ConfigError(f"tiny target hidden_size={hidden_size}: must be a positive multiple of 4")
    if num_layers < 1:
        raise ConfigError(f"tiny target num_layers={num_layers}: must be >= 1")
    return Qwen3Config(
        vocab_size=tiny_vocab_size(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=8192,
        initializer_range=TINY_INITIALIZER_RANGE,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT),
    )


def _silence_padding_rows(model, num_tokens: int) -> None:
    """Zero the LM-head rows of the embedding table's padding ids (>= num_tokens).

    A trained model never predicts ids no tokenizer can write; a random head would, now
    and then (measured: ~1% of greedy tokens at initializer_range 0.15). With zero rows their
    logit is exactly 0, below the largest of ~1000 random logits in practice.
    """
    import torch

    with torch.no_grad():
        model.get_output_embeddings().weight[num_tokens:] = 0


def write_random_model(out_dir: str, build, tokenizer, *, seed: int, text_only: bool = True):
    """`build()`'s random-weight model, seeded, saved with `tokenizer` through `save_pretrained`
    (the one way the tiny target, the test architectures and the bench shapes are written).
    ``text_only``: the LM-head rows of ids the tokenizer cannot write are zeroed
    (`_silence_padding_rows`). Returns the model."""
    import torch

    # fork_rng: building a target inside a test or a worker must not move the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
        if text_only:
            _silence_padding_rows(model, len(tokenizer))
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return model


def _write_target(tmp_dir: str, params: dict, num_layers: int, hidden_size: int, seed: int) -> None:
    import torch
    from transformers import Qwen3ForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = _tiny_config(tokenizer, num_layers, hidden_size)
    write_random_model(tmp_dir, lambda: Qwen3ForCausalLM(config).to(torch.float32).eval(), tokenizer, seed=seed)
    # Written last: its presence is what marks the directory complete.
    with open(os.path.join(tmp_dir, _COMPLETE_MARKER), "w") as f:
        json.dump(params, f, indent=2, sort_keys=True)


def build_tiny_target(
    out_dir: str,
    *,
    num_layers: int = 4,
    hidden_size: int = 128,
    seed: int = 0,
    overwrite: bool = False,
) -> str:
    """Build (once) the tiny Qwen3 target + tokenizer in out_dir and return out_dir.

    Qwen3Config: 4 heads, 2 KV heads, head_dim hidden/4, intermediate 2*hidden, vocab =
    tokenizer size rounded up to 64, fp32 weights from a fixed seed. Atomic (built in a
    temporary sibling directory, then renamed) and idempotent: a complete target with the
    same parameters is reused; a different one raises DataError unless overwrite.
    Safe when several processes build the same out_dir at once: one rename wins.
    """
    out_dir = os.path.abspath(out_dir)
    params = _build_params(num_layers, hidden_size, seed)
    existing = _read_complete(out_dir)
    if existing == params and not overwrite:
        return out_dir
    if os.path.exists(out_dir) and not overwrite:
        found = existing if existing is not None else "not a complete tiny target"
        raise DataError(
            f"{out_dir}: already exists and holds a different build ({found}); wanted {params}. "
            "Pass overwrite=True or choose another directory."
        )
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    try:
        _write_target(tmp_dir, params, num_layers, hidden_size, seed)
        if overwrite and os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        try:
            os.rename(tmp_dir, out_dir)
        except OSError:
            # Another process renamed its build first; use it if it is the same build.
            if _read_complete(out_dir) != params:
                raise
            log.info("tiny target %s was built concurrently by another process; reusing it", out_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    log.info("built tiny target in %s (%s)", out_dir, params)
    return out_dir
