"""Inference export of a trained drafter: ``config.json`` + ``model.safetensors``.

The directory is what SGLang (``--speculative-algorithm DFLASH``) and vLLM
(``method: dflash``) load as a DFlash draft model, and what z-lab's ``DFlashDraftModel``
(HF ``trust_remote_code``) reads. Neither the embedding nor the LM head is written:
serving uses the target's.

Sources checked for what the loaders read (public code, read through the search tools):
- sgl-project/sglang ``python/sglang/srt/models/dflash.py``: ``DFlashDraftModel`` builds
  ``layers.{i}`` (q/k/v_proj fused on load into qkv_proj, gate/up into gate_up_proj),
  ``fc`` (no bias, in = K*hidden), ``hidden_norm``, ``norm``; accepts names with or
  without a ``model.`` prefix; rejects an fc shape that disagrees with the config.
- sgl-project/sglang ``python/sglang/srt/speculative/dflash_utils.py``
  (``parse_dflash_draft_config``): ``dflash_config.{target_layer_ids, mask_token_id,
  block_size, num_target_layers}``, each falling back to the top-level key;
  ``num_hidden_layers``; ``layer_types`` ("full_attention" -> non-causal attention);
  ``rope_theta``/``rope_scaling`` via ``get_rope_config``; ``hidden_act`` must be silu.
- vllm-project/vllm ``vllm/model_executor/models/qwen3_dflash.py``: prefixes every name
  but ``lm_head*`` with ``model.``, maps q/k/v and gate/up into fused params; reads
  ``dflash_config.mask_token_id``, ``layer_types`` (all full -> non-causal),
  ``rope_parameters``, ``max_position_embeddings``, ``head_dim``, ``attention_bias``;
  context K/V = k/v_proj(hidden_norm(fc(features))) then k_norm and RoPE.
- vLLM ``eagle3_utils.get_eagle3_aux_layers_from_config``: capture layers are
  ``dflash_config.target_layer_ids`` + 1 (newer versions; older ones read only
  ``eagle_aux_hidden_state_layer_ids``, which this export does not write).
- z-lab/dflash ``dflash/model.py`` and its test fixtures: ``DFlashDraftModel``
  (Qwen3Config-based) reads ``dflash_config.target_layer_ids``/``mask_token_id`` and
  ``block_size``; published configs carry top-level ``block_size`` and
  ``num_target_layers``, ``model_type: qwen3``, safetensors names without prefix.

Sliding-window layers (``model.layer_types``, ``model.sliding_window``). Every loader reads
config.json through transformers' ``Qwen3Config``, which keeps ``sliding_window`` only with
``use_sliding_window: true``; the export sets it whenever a layer slides. Read in SGLang 0.5.23
and vLLM 0.33.0 (their PyPI wheels), z-lab/dflash 44947fb, SpecForge a6b6b02:
- SGLang ``srt/speculative/dflash_utils.py:388-397``: ``layer_types`` (text config, else top
  level); ``:400-417``: the window is ``sliding_window`` (``dflash_config.swa_window_size`` only
  for the Nemotron 3.5 layout, ``:409-410``), required once a layer slides, served as
  ``sliding_window - 1`` (HF windows count the query itself). ``srt/models/dflash.py:166-191``:
  ``full_attention`` -> no window, non-causal; ``sliding_attention`` -> that window, causal;
  ``:157-163``: a config ``is_causal`` would set the causality of every layer.
  ``srt/speculative/dflash_worker_v2.py:405-406, 1209-1214``: the server flag
  ``--speculative-draft-window-size`` clamps the context of every drafter layer.
- vLLM ``model_executor/models/qwen3_dflash.py:96-156`` (``_resolve_layer_attention``): a layer
  slides iff ``layer_types[i] == "sliding_attention"`` (``dflash_config.use_swa`` slides every
  layer when none is listed as sliding); the window is ``dflash_config.swa_window_size``, else
  ``sliding_window``; ``:62-73``: causal is ``is_causal``, else ``dflash_config.causal``, else
  whether the layer slides. ``config/vllm.py:3129-3131``: a mix of sliding and full layers is
  refused by the V1 model runner (V2 is the default, ``:748-767``). ``v1/attention/backends/
  flash_attn.py:1082-1087``: a causal window w is ``(w - 1, 0)`` keys left and right of the
  query, as HF's.
- z-lab ``dflash/model.py:209``: ``config.sliding_window`` where ``layer_types[i]`` slides, handed
  to transformers' attention function (``:250``) of a non-causal module (``:194``): SDPA ignores
  it, flash-attention applies it on both sides (transformers 5.24
  ``modeling_flash_attention_utils.py:687-692``), neither the servers' causal window.
- SpecForge ``configs/qwen3.6-27b-dflash.json:29-49`` writes this export's set: ``layer_types``,
  ``max_window_layers`` (the layer count), ``sliding_window``, ``use_sliding_window: true``;
  ``specforge/modeling/draft/dflash.py:38-68`` requires the window once a layer slides.
The export writes none of ``is_causal``, ``dflash_config.{causal, use_swa, swa_window_size}``,
so each loader's per-layer default applies, which is the trainer's rule (sliding: causal and
windowed; full: the whole block). ``max_window_layers`` states the layout in Qwen2's form
(layers from it on slide) when the sliding layers are the last ones, else it is the layer
count and ``layer_types`` alone decides (model.qwen2_max_window_layers). vllm-project/
speculators writes another format (``transformer_layer_config``, ``sliding_window_non_causal``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable

import torch

from dflash_ipc.run.checkpoints import MANIFEST, STATE_TENSORS, UNCOMMITTED, CheckpointStore, verify_dir
# EXPORT_FILES: imported by readers of this module's export layout (tests, the model card)
from dflash_ipc.drafter.export_dir import CONFIG_FILE, EXPORT_FILES, WEIGHTS_FILE, check_export_target  # noqa: F401
from dflash_ipc.drafter.model import DFlashConfig, DFlashDraftModel
from dflash_ipc.config.dtypes import DTYPE_OF_TORCH
from dflash_ipc.errors import DataError
from dflash_ipc.run.json_files import read_json_object
from dflash_ipc.run.regular_file import regular_file

logger = logging.getLogger(__name__)

_LAYER_NAME = re.compile(r"^layers\.(\d+)\.")

# The exact keys of the config.json written by save_inference_checkpoint.
CONFIG_KEYS: tuple[str, ...] = (
    "architectures", "model_type", "block_size", "dflash_config", "num_target_layers",
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "max_position_embeddings", "vocab_size", "attention_bias",
    "attention_dropout", "tie_word_embeddings", "layer_types", "use_sliding_window",
    "sliding_window", "max_window_layers", "initializer_range", "use_cache", "torch_dtype", "dtype",
)
DFLASH_CONFIG_KEYS: tuple[str, ...] = ("mask_token_id", "target_layer_ids")



def expected_tensor_shapes(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint and its shape, derived from the config alone."""
    h, d = config.hidden_size, config.head_dim
    qd, kvd, inter = config.num_attention_heads * d, config.num_key_value_heads * d, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, config.num_context_features * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (qd, h),
            p + "self_attn.k_proj.weight": (kvd, h),
            p + "self_attn.v_proj.weight": (kvd, h),
            p + "self_attn.o_proj.weight": (h, qd),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
    return shapes


def inference_config(config: DFlashConfig, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The config.json dict; raises if its keys drift from CONFIG_KEYS."""
    if dtype not in DTYPE_OF_TORCH:
        raise DataError(f"export dtype {dtype} not in {list(DTYPE_OF_TORCH)}")
    d = config.to_hf_dict(dtype=DTYPE_OF_TORCH[dtype])
    if tuple(d) != CONFIG_KEYS or tuple(d["dflash_config"]) != DFLASH_CONFIG_KEYS:
        raise AssertionError(f"to_hf_dict keys {list(d)} drifted from export.CONFIG_KEYS")
    return d


def save_inference_checkpoint(model: DFlashDraftModel, out_dir: str, *, dtype: torch.dtype = torch.bfloat16,
                              extras: Callable[[str], None] | None = None) -> None:
    """Write ``out_dir/{config.json, model.safetensors}`` atomically.

    Everything is written into ``out_dir.tmp-<pid>`` first and renamed into place, so a
    reader sees either the previous complete export or the new one, never a half file.
    An existing ``out_dir`` is replaced only when it is empty or an earlier export
    (`check_export_target`): moved aside and removed after the rename. ``extras(tmp_dir)``
    adds files before the rename (the model card, ``--with-code``: model_card.py, hub_code.py).
    """
    out_dir = os.path.abspath(out_dir)
    check_export_target(out_dir)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    # A fresh name (mkdtemp), never a fixed one removed first: a directory of the user's that
    # happens to be called `OUT.tmp-<pid>` is not ours to remove.
    tmp = tempfile.mkdtemp(prefix=f"{os.path.basename(out_dir)}.tmp-", dir=os.path.dirname(out_dir))
    try:
        write_inference_files(model, tmp, dtype=dtype)
        if extras is not None:
            extras(tmp)
        replaced = os.path.exists(out_dir)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("exported drafter (%s) to %s%s", DTYPE_OF_TORCH[dtype], out_dir,
                " (replacing the directory that was there)" if replaced else "")


def write_inference_files(model: DFlashDraftModel, directory: str, *, dtype: torch.dtype = torch.bfloat16,
                          state: dict | None = None) -> None:
    """``config.json`` + ``model.safetensors`` into an existing directory (`state`: the model's
    full state dict when `model` is sharded, drafter/sharding.py)."""
    from safetensors.torch import save_file

    config = inference_config(model.config, dtype)
    state = {name: t.detach().to(device="cpu", dtype=dtype).contiguous()
             for name, t in (model.state_dict() if state is None else state).items()}
    expected = expected_tensor_shapes(model.config)
    if {n: tuple(t.shape) for n, t in state.items()} != expected:
        raise AssertionError(f"model tensors {sorted(state)} do not match the export layout")
    with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    weights = os.path.join(directory, WEIGHTS_FILE)
    save_file(state, weights, metadata={"format": "pt"})
    # safetensors writes 0600; the weights get the config's mode (0644 under the usual umask),
    # or a server running as another user could read the config but not them.
    shutil.copymode(os.path.join(directory, CONFIG_FILE), weights)


def _replace_dir(src: str, dst: str) -> None:
    """rename(src, dst); a directory cannot be renamed over a non-empty one, so move it aside."""
    old = None
    if os.path.exists(dst):
        old = tempfile.mkdtemp(prefix=f"{os.path.basename(dst)}.old-", dir=os.path.dirname(dst))
        os.replace(dst, old)  # a directory may be renamed over an empty one
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def load_inference_checkpoint(
    path: str, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> DFlashDraftModel:
    """Rebuild a DFlashDraftModel from an export directory (ours or a z-lab one).

    ``dtype=None`` keeps the stored dtype. Missing or unexpected tensors, or wrong shapes,
    raise DataError naming the file.
    """
    from safetensors import SafetensorError, safe_open

    cfg_path, w_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    for p in (cfg_path, w_path):
        try:  # a FIFO or /dev/zero would hang the reads below
            regular_file(p, "a drafter export file", inside=path)
        except FileNotFoundError:
            raise DataError(f"{p}: missing (not a drafter export directory)") from None
    raw = read_json_object(cfg_path, "drafter config")
    try:
        with safe_open(w_path, framework="pt", device="cpu") as f:  # the header only
            _check_layer_count(w_path, set(f.keys()), raw.get("num_hidden_layers"))
        # Only now is anything sized by the config built (per-layer lists, the tensor layout).
        config = DFlashConfig.from_hf_dict(raw, source=cfg_path)
    except (OSError, SafetensorError, RuntimeError) as e:
        raise DataError(f"{w_path}: unreadable ({str(e)[:200]})") from None
    except (ValueError, TypeError, OverflowError) as e:
        if isinstance(e, DataError):
            raise
        message = str(e)  # from_hf_dict's own errors name the file already (source=cfg_path)
        raise DataError(message[:300] if message.startswith(cfg_path) else f"{cfg_path}: {message[:300]}") from None
    try:
        state = _read_weights(w_path, config, device, dtype)
    except (OSError, SafetensorError, RuntimeError) as e:
        raise DataError(f"{w_path}: unreadable ({str(e)[:200]})") from None
    with torch.device("meta"):
        model = DFlashDraftModel(config)
    model.load_state_dict(state, strict=True, assign=True)
    return model


def _read_weights(w_path: str, config: DFlashConfig, device, dtype) -> dict:
    """The tensors of `w_path`, exactly the names and shapes `config` implies, all floating point."""
    from safetensors import safe_open

    state = {}
    with safe_open(w_path, framework="pt", device="cpu") as f:
        names = set(f.keys())
        expected = expected_tensor_shapes(config)
        if names != set(expected):
            raise DataError(
                f"{w_path}: missing tensors {sorted(set(expected) - names)[:5]}, "
                f"unexpected tensors {sorted(names - set(expected))[:5]}"
            )
        for name in names:
            t = f.get_tensor(name)
            if tuple(t.shape) != expected[name]:
                raise DataError(f"{w_path}: {name} has shape {tuple(t.shape)}, config implies {expected[name]}")
            if not t.dtype.is_floating_point:
                raise DataError(f"{w_path}: {name} is {t.dtype}, not a floating-point tensor")
            state[name] = t.to(device=device, dtype=dtype or t.dtype)
    return state


def _check_layer_count(w_path: str, names: set[str], declared) -> None:
    """config.json's num_hidden_layers (as read, before DFlashConfig builds per-layer lists
    from it) against the layers the weights hold: a config that claims a million layers is
    refused before anything a million layers long is built. A value that is no int is left
    to DFlashConfig's own error."""
    held = {m.group(1) for name in names if (m := _LAYER_NAME.match(name))}
    if isinstance(declared, int) and not isinstance(declared, bool) and declared != len(held):
        raise DataError(f"{w_path}: holds {len(held)} layers, but {CONFIG_FILE} beside it says num_hidden_layers "
                        f"{declared}; the two are not one export")


def checkpoint_step_dir(checkpoint: str) -> str:
    """A `step_N/` directory, or the checkpoints root whose latest.json names the newest
    committed one; a checkpoint with a manifest is verified against it."""
    step_dir = checkpoint
    if not os.path.exists(os.path.join(checkpoint, CONFIG_FILE)):
        step_dir = CheckpointStore(checkpoint).latest()
        if step_dir is None:
            raise DataError(f"{checkpoint}: neither a checkpoint ({CONFIG_FILE}) nor a root with latest.json")
    if os.path.exists(os.path.join(step_dir, MANIFEST)):
        verify_dir(step_dir)
    if os.path.basename(os.path.dirname(os.path.abspath(step_dir))) == UNCOMMITTED:
        logger.warning("%s was written but never committed (a job killed between the two): its training "
                       "may have continued differently", step_dir)
    return step_dir


def export_training_checkpoint(checkpoint: str, out_dir: str, *, dtype: torch.dtype = torch.bfloat16,
                               extras: Callable[[str], None] | None = None) -> str:
    """Inference export of a trainer checkpoint; returns ``out_dir``.

    ``checkpoint`` is a ``step_N/`` directory written by the drafter trainer, or the
    checkpoint root holding its ``latest.json``. Weights come from the full-precision
    training state when it is there (the ``model.safetensors`` beside it is already
    rounded to the export dtype), else from that ``model.safetensors``. Nothing read
    can execute code (safetensors and JSON only).
    """
    return export_step_dir(checkpoint_step_dir(checkpoint), out_dir, dtype=dtype, extras=extras)


def export_step_dir(step_dir: str, out_dir: str, *, dtype: torch.dtype = torch.bfloat16,
                    extras: Callable[[str], None] | None = None) -> str:
    """`export_training_checkpoint` of a step directory `checkpoint_step_dir` has already
    resolved and verified (the checksums of a large training state are read once)."""
    from safetensors import SafetensorError, safe_open

    check_export_target(os.path.abspath(out_dir))  # before a large checkpoint is read for nothing
    model = load_inference_checkpoint(step_dir, dtype=torch.float32)  # also validates the step dir
    state_path = os.path.join(step_dir, STATE_TENSORS)
    if os.path.exists(state_path):
        regular_file(state_path, "the training state", inside=step_dir)
        try:
            with safe_open(state_path, framework="pt", device="cpu") as f:
                state = {n[len("model."):]: f.get_tensor(n) for n in f.keys() if n.startswith("model.")}
            model.load_state_dict(state, strict=True)
        except (OSError, SafetensorError, RuntimeError) as e:
            raise DataError(f"{state_path}: its model tensors do not match {step_dir}/{CONFIG_FILE} ({e})") from e
    save_inference_checkpoint(model, out_dir, dtype=dtype, extras=extras)
    return out_dir
