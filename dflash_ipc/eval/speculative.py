"""`dflash-ipc eval`: batched speculative decoding of prompt sets, measured against plain decoding.

For each prompt set (a dataset's held-out prompts, JSONL prompt files) the same prompts run
through :class:`~dflash_ipc.eval.decoding.PlainDecoder` once and through
:class:`~dflash_ipc.eval.decoding.SpeculativeDecoder` per drafter, with one loaded target,
``batch_size`` sequences in flight; each run reports tau, acceptance by block position,
tokens, wall time and tokens/s, and the speculative run its speedup over the plain one.
With ``check_lossless`` (greedy only) every prompt's two outputs are compared
(lossless.py: identical, numerical near-tie, mismatch).

Usage:
    reports = evaluate_sets("models/Qwen3-8B", "runs/qwen3-8b/checkpoints",
                            data_dir="data/chats", prompt_files=["gsm8k=gsm8k/test.jsonl"],
                            options=EvalOptions(max_new_tokens=256, batch_size=64, check_lossless=True))
    print("\\n".join(r.format() for r in reports))
    untrained, trained = untrained_vs_trained(target_dir, checkpoints_dir, data_dir)
    print(format_comparison(untrained, trained))

Held-out prompts of a dataset: by default the prompts it declares held out (meta.json
"extra.held_out": the built-in synthetic data, or ``prepare --held-out``), else its last
``num_prompts`` usable samples (a prompt is a sample's tokens before its first loss-mask
token); those are held out only if they were not trained on.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dflash_ipc.data.dataset import TokenDataset
from dflash_ipc.run.checkpoints import LATEST, MANIFEST, CheckpointStore, verify_dir
from dflash_ipc.drafter.inference_format import CONFIG_FILE, load_inference_checkpoint
from dflash_ipc.drafter.model import DFlashDraftModel
from dflash_ipc.errors import ConfigError, DataError
from dflash_ipc.hf.hub import resolve_dataset, resolve_model
from dflash_ipc.eval.acceptance import AcceptanceStats
from dflash_ipc.eval.decoding import PREFILL_TOKENS, DecodeRun, PlainDecoder, SpeculativeDecoder
from dflash_ipc.eval.drafter_context import DrafterContext
from dflash_ipc.eval.lossless import NEAR_TIE_ULPS, compare
from dflash_ipc.eval.progress import EvalProgress
from dflash_ipc.eval.prompt_sets import (
    ChatRenderer,
    Conversations,
    PromptSet,
    check_token_ids,
    held_out_prompts,
    held_out_set,
    prompt_set_arg,
    read_prompt_file,
)
from dflash_ipc.eval.report import EvalReport, PlainFigures, SampleResult
from dflash_ipc.decode.requests import Request, RequestList
from dflash_ipc.eval.sampling import Sampling
from dflash_ipc.data.stops import stop_token_ids
from dflash_ipc.decode.sampler import check_seed
from dflash_ipc.decode.target import BatchedTarget, TargetModel, resolve_dtype
from dflash_ipc.eval.unbatched import DFlashProposer, TargetLM, UnbatchedDecoder

__all__ = ["EvalOptions", "evaluate", "evaluate_sets", "held_out_prompts", "load_drafter", "resolve_dtype",
           "stop_token_ids", "untrained_vs_trained"]

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 64
DEFAULT_HELD_OUT_PROMPTS = 16


@dataclass(kw_only=True)
class EvalOptions:
    """How every prompt set is decoded."""

    max_new_tokens: int = 64
    """Budget of every generation (every turn)."""
    batch_size: int = DEFAULT_BATCH_SIZE
    """Sequences in flight."""
    sampling: Sampling = field(default_factory=Sampling)
    plain: bool = True
    """Also decode plainly: tokens/s, speedup and the lossless check need it."""
    check_lossless: bool = False
    """Compare each output with plain greedy decoding (greedy only)."""
    near_tie_ulps: float = NEAR_TIE_ULPS
    progress: Callable[[str], None] | None = None
    """Where progress lines go (None: nowhere)."""
    prefill_tokens: int = PREFILL_TOKENS
    timing_repeats: int = 1
    """(plain, speculative) pairs per drafter, each run back to back on the same two decoders: the
    first gives the reported outputs; the speedup is the median of the others (their range is
    printed), or the first pair's ratio when there is one pair."""

    def __post_init__(self) -> None:
        if self.timing_repeats < 1:
            raise ConfigError(f"timing_repeats={self.timing_repeats} must be >= 1")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if not (math.isfinite(self.near_tie_ulps) and self.near_tie_ulps >= 0):
            # inf (or nan) would call every difference a near-tie: --check-lossless could never fail
            raise ConfigError(f"--near-tie-ulps={self.near_tie_ulps}: must be a finite number >= 0")
        if self.check_lossless and not self.sampling.greedy:
            raise ConfigError(f"the lossless check compares greedy outputs; got temperature="
                              f"{self.sampling.temperature} (use --temperature 0)")
        if self.check_lossless and not self.plain:
            raise ConfigError("the lossless check needs the plain decoding run (do not skip it)")


def load_drafter(drafter: str | DFlashDraftModel, *, device: str | torch.device,
                 dtype: torch.dtype) -> tuple[DFlashDraftModel, str]:
    """(model on device in dtype, a label). Accepts a model, an export or checkpoint step
    directory (config.json + model.safetensors), or a checkpoints root (its latest.json).
    A model already on ``device`` in ``dtype`` is used as is; otherwise a converted copy."""
    if isinstance(drafter, DFlashDraftModel):
        p = next(drafter.parameters())
        if p.device != torch.device(device) or p.dtype != dtype:
            drafter = copy.deepcopy(drafter).to(device=device, dtype=dtype)
        return drafter.eval(), "in-memory drafter"
    path = os.fspath(drafter)
    if os.path.isfile(os.path.join(path, LATEST)):
        path = CheckpointStore(path).latest()
    if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        raise DataError(f"{drafter}: not a drafter export, checkpoint step directory or checkpoints root "
                        f"(no {CONFIG_FILE}, no {LATEST})")
    if os.path.isfile(os.path.join(path, MANIFEST)):
        verify_dir(path)  # a checkpoint step directory: used only as written (checksums)
    return load_inference_checkpoint(path, device=device, dtype=dtype).eval(), path


def check_compatible(model: DFlashDraftModel, target: TargetModel, source: str) -> None:
    """ConfigError unless the drafter was made for this target's shape."""
    c = model.config
    for name, mine, theirs in (("hidden_size", c.hidden_size, target.hidden_size),
                               ("vocab_size", c.vocab_size, target.head.vocab_size),
                               ("num_target_layers", c.num_target_layers, target.num_layers)):
        if mine != theirs:
            raise ConfigError(f"{source}: drafter {name}={mine} but the target has {theirs}; "
                              "the drafter was trained for another target")


def untrained_like(model: DFlashDraftModel, seed: int) -> DFlashDraftModel:
    """A fresh drafter of ``model``'s config and device/dtype, initialised from ``seed`` (the
    caller's RNG state is left alone)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        untrained = DFlashDraftModel(model.config)
    p = next(model.parameters())
    return untrained.to(device=p.device, dtype=p.dtype).eval()


def prompt_sets(target_dir: str, *, data_dir: str | None = None, prompt_files: Sequence[str] = (),
                num_prompts: int | None = None, held_out: Sequence[int] | None = None) -> list[PromptSet]:
    """The sets to evaluate: the dataset's held-out prompts (``num_prompts``, default 16), then each
    prompt file (``NAME=PATH`` or ``PATH``; its first ``num_prompts`` rows, default all)."""
    sets = []
    if data_dir is not None:
        dataset = TokenDataset(data_dir)
        dataset.check_tokenizer(target_dir)
        held = held_out_set(dataset, num_prompts=num_prompts or DEFAULT_HELD_OUT_PROMPTS, sample_ids=held_out)
        check_token_ids(held, _target_vocab_size(target_dir))  # before the target is loaded
        sets.append(held)
    for arg in prompt_files:
        name, path = prompt_set_arg(arg)
        path = resolve_dataset(path, what="--prompts")
        sets.append(read_prompt_file(path, name=name, limit=num_prompts))
    if not sets:
        raise ConfigError("eval: no prompts; give --data DIR (its held-out prompts) and/or --prompts FILE.jsonl")
    names = [s.name for s in sets]
    for i, s in enumerate(sets):
        if names.count(s.name) > 1:
            s.name = f"{s.name}#{i}"
    return sets


def _target_vocab_size(target_dir: str) -> int:
    from dflash_ipc.hf.target_config import load_target_config
    from dflash_ipc.hf.text_stack import text_config
    return int(text_config(load_target_config(target_dir)).vocab_size)


def evaluate_sets(target_dir: str, drafter: str | DFlashDraftModel, *, data_dir: str | None = None,
                  prompt_files: Sequence[str] = (), num_prompts: int | None = None,
                  held_out: Sequence[int] | None = None, device: str = "cpu", dtype: str = "auto",
                  vs_untrained: bool = False, seed: int = 0, template_kwargs: dict | None = None,
                  options: EvalOptions | None = None, label: str | None = None) -> list[EvalReport]:
    """One report per (prompt set, drafter): sets in order, and per set the untrained drafter
    (``vs_untrained``, a fresh one from ``seed``) before ``drafter`` (see :func:`load_drafter`)."""
    options = options or EvalOptions()
    check_seed(seed, "--seed")  # seeds the untrained drafter; checked before anything is loaded
    target_dir = resolve_model(target_dir, what="--target")
    if isinstance(drafter, str):
        drafter = resolve_model(drafter, what="--drafter")
    model, source = load_drafter(drafter, device=device, dtype=resolve_dtype(dtype, device))
    sets = prompt_sets(target_dir, data_dir=data_dir, prompt_files=prompt_files, num_prompts=num_prompts,
                       held_out=held_out)
    target = load_target(target_dir, model.config.target_layer_ids, device=device, dtype=dtype, options=options)
    check_compatible(model, target, source)
    drafters = [("untrained", untrained_like(model, seed))] if vs_untrained else []
    drafters.append((label or (f"trained ({source})" if vs_untrained else f"drafter {source}"), model))
    renderer = None
    if any(c.prompt_ids is None for s in sets for c in s.cases):
        from transformers import AutoTokenizer
        renderer = ChatRenderer(AutoTokenizer.from_pretrained(target_dir), template_kwargs)
    reports = []
    for prompt_set in sets:
        reports += run_set(target, drafters, prompt_set, renderer=renderer, options=options)
    return reports


def load_target(target_dir: str, layer_ids: Sequence[int], *, device: str, dtype: str,
                options: EvalOptions) -> TargetModel:
    """The batched target, or for a target with linear-attention (recurrent) layers, which it does
    not run, the unbatched one (greedy, one prompt at a time)."""
    from dflash_ipc.hf.target_config import load_target_config
    from dflash_ipc.hf.text_stack import has_recurrent_layers

    if not has_recurrent_layers(load_target_config(target_dir)):
        return BatchedTarget(target_dir, layer_ids=layer_ids, device=device, dtype=dtype)
    if not options.sampling.greedy:
        raise ConfigError(f"target {target_dir} has linear-attention (recurrent) layers: eval decodes it one "
                          f"prompt at a time, greedy only; got temperature={options.sampling.temperature} "
                          "(use --temperature 0)")
    logger.warning("target %s has linear-attention (recurrent) layers: decoding one prompt at a time (greedy; "
                   "a rejected draft re-runs the kept prefix), --batch-size is not used", target_dir)
    return TargetLM(target_dir, layer_ids=layer_ids, device=device, dtype=dtype)


def plain_decoder(target: TargetModel, *, keep_cache: bool = False, **kw):
    """``keep_cache``: the batched decoder keeps its cache and graphs for the next run (timing repeats)."""
    if isinstance(target, BatchedTarget):
        return PlainDecoder(target, keep_cache=keep_cache, **kw)
    return UnbatchedDecoder(target, **kw)


def speculative_decoder(target: TargetModel, model: DFlashDraftModel, **kw):
    if isinstance(target, BatchedTarget):
        return SpeculativeDecoder(target, DrafterContext(model, target.head), **kw)
    return UnbatchedDecoder(target, DFlashProposer(model, target.head), **kw)


def run_set(target: TargetModel, drafters: Sequence[tuple[str, DFlashDraftModel]], prompt_set: PromptSet, *,
            renderer: ChatRenderer | None, options: EvalOptions) -> list[EvalReport]:
    """Plain decoding once (``options.plain``), then speculative decoding with each drafter."""
    # Every run of the set (plain and each drafter's) gets the same budgets: those that fit the
    # target's positions with the largest draft block after them, so the outputs stay comparable.
    max_positions = getattr(getattr(target, "text_config", None), "max_position_embeddings", None)
    reserve = max(model.config.block_size for _, model in drafters)
    first: list[Conversations] = []

    def source() -> Conversations:
        conversations = Conversations(prompt_set, max_new_tokens=options.max_new_tokens, renderer=renderer,
                                      stop_token_ids=target.stop_token_ids, max_positions=max_positions,
                                      reserve=reserve)
        first[:] = first or [conversations]
        return conversations

    def decoder_kw(what: str) -> dict:
        unit = "prompts" if prompt_set.num_turns == len(prompt_set.cases) else "turns"
        progress = (EvalProgress(f"[{prompt_set.name}] {what}", prompt_set.num_turns, options.progress, unit=unit)
                    if options.progress else None)
        return dict(batch_size=options.batch_size, sampling=options.sampling, prefill_tokens=options.prefill_tokens,
                    progress=progress)

    _warm_up(target, drafters, source().next_request(), options)
    repeats = options.timing_repeats if options.plain else 1
    plain_dec = plain_decoder(target, **decoder_kw("plain"), keep_cache=repeats > 1) if options.plain else None
    plain = plain_dec.run(source()) if plain_dec else None
    reports = []
    _warn_capped(prompt_set, first[0], max_positions, options.max_new_tokens)
    for label, model in drafters:
        spec_dec = speculative_decoder(target, model, **decoder_kw(label))
        run = spec_dec.run(source())
        report = build_report(label, prompt_set, run, plain, options, dtype=target.dtype,
                              block_size=model.config.block_size, device=device_name(target.device))
        if plain is not None:
            # The first pair's outputs are the report's; its times hold first-call costs (the
            # decoders' caches and CUDA graphs are made during it). Repeated pairs reuse both
            # decoders, run back to back, and only they are timed.
            pairs = [(plain_dec.run(source()), spec_dec.run(source())) for _ in range(repeats - 1)]
            report.speedups = [_speedup(p, s) for p, s in pairs] or [_speedup(plain, run)]
        reports.append(report)
        _release(spec_dec)
    if plain_dec is not None:
        _release(plain_dec)
    return reports


def _release(decoder) -> None:
    """Free a batched decoder's caches and graphs now (the unbatched decoder keeps none between runs)."""
    release = getattr(decoder, "release", None)
    if release is not None:
        release()


def _warn_capped(prompt_set: PromptSet, conversations: Conversations, max_positions, max_new_tokens: int) -> None:
    """One warning per set for the first turns whose budget the target's positions cut (those of the
    set's first source, which renders every case's first turn up front)."""
    capped = getattr(conversations, "capped", ())  # a stand-in source (tests) has none
    if capped:
        logger.warning("[%s] %d turn(s) get fewer than --max-new-tokens %d new tokens: their prompt and a draft "
                       "block fill the target's %d positions otherwise (plain and speculative alike), e.g. %s",
                       prompt_set.name, len(capped), max_new_tokens, max_positions, capped[0])


def _speedup(plain: DecodeRun, spec: DecodeRun) -> float:
    """Speculative over plain tokens/s of two runs of the same prompts."""
    if plain.wall_s <= 0 or spec.wall_s <= 0 or not plain.num_generated:
        return math.nan
    return (spec.num_generated / spec.wall_s) / (plain.num_generated / plain.wall_s)


def device_name(device: torch.device) -> str:
    """What a speedup was measured on: the GPU's name, or the CPU's architecture and threads."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def _warm_up(target: TargetModel, drafters, request: Request, options: EvalOptions) -> None:
    """One short untimed run of each decoder at batch 1: the drafter's fused kernels compiled on
    CUDA and lazy initialisation done. What depends on the batch (the caches, CUDA graphs per
    shape) is made by the first real pair, which is why repeated pairs time only the later ones."""
    budget = min(request.max_new_tokens, 32 if target.device.type == "cuda" else 8)  # what fits its positions
    short = Request(key=request.key, prompt_ids=request.prompt_ids, max_new_tokens=budget)
    kw = dict(batch_size=1, sampling=options.sampling)
    plain_decoder(target, **kw).run(RequestList([short]))  # frees its cache at the end of the run
    for _, model in drafters:
        decoder = speculative_decoder(target, model, **kw)
        decoder.run(RequestList([short]))
        _release(decoder)


def build_report(label: str, prompt_set: PromptSet, run: DecodeRun, plain: DecodeRun | None, options: EvalOptions,
                 *, dtype: torch.dtype, block_size: int, device: str = "") -> EvalReport:
    """The report of one speculative run; lossless verdicts per turn until a case's first difference
    (its later turns had other prompts)."""
    plain_by_key: dict = {g.request.key: g for g in plain.generations} if plain else {}
    stats, samples, diverged = AcceptanceStats(block_size=block_size), [], set()
    for gen in sorted(run.generations, key=lambda g: g.request.key):
        sample_id, turn = gen.request.key
        stats.merge(gen.stats)
        check = None
        if options.check_lossless and sample_id not in diverged:
            check = compare(gen, plain_by_key[gen.request.key], dtype=dtype, near_tie_ulps=options.near_tie_ulps)
            if check.verdict != "identical":
                diverged.add(sample_id)
                log = logger.error if check.verdict == "mismatch" else logger.warning
                log("%s [%s]: sample %s turn %d differs from plain greedy decoding at token %s: %s", label,
                    prompt_set.name, sample_id, turn, check.position, check.verdict)
        samples.append(SampleResult(sample_id=sample_id, turn=turn, prompt_len=gen.prompt_len, output_ids=gen.tokens,
                                    stats=gen.stats, stopped=gen.stopped, check=check))
    report = EvalReport(label=label, stats=stats, samples=samples, max_new_tokens=options.max_new_tokens,
                        wall_s=run.wall_s, prompt_set=prompt_set.name, batch_size=options.batch_size,
                        sampling=options.sampling.to_dict(), dtype=str(dtype).removeprefix("torch."), device=device,
                        plain=PlainFigures(num_generated=plain.num_generated, wall_s=plain.wall_s) if plain else None)
    logger.info("%s [%s]: tau %.3f on %d prompts, %d tokens, %.1fs, %.1f tok/s", label, prompt_set.name, report.tau,
                len(report.sample_ids), stats.num_generated, report.wall_s, report.tokens_per_s)
    return report


def evaluate(target_dir: str, drafter: str | DFlashDraftModel, data_dir: str, *,
             num_prompts: int = DEFAULT_HELD_OUT_PROMPTS, max_new_tokens: int = 64, device: str = "cpu",
             held_out: Sequence[int] | None = None, dtype: str = "auto", check_lossless: bool = False,
             label: str | None = None, batch_size: int = DEFAULT_BATCH_SIZE) -> EvalReport:
    """The report of ``drafter`` on the held-out prompts of ``data_dir`` (greedy).

    ``held_out``: sample ids of ``data_dir`` to use (``num_prompts`` is then ignored); default
    ``num_prompts`` prompts the data declares held out, else its last usable samples.
    """
    options = EvalOptions(max_new_tokens=max_new_tokens, batch_size=batch_size, check_lossless=check_lossless)
    return evaluate_sets(target_dir, drafter, data_dir=data_dir, num_prompts=num_prompts, held_out=held_out,
                         device=device, dtype=dtype, options=options, label=label)[0]


def untrained_vs_trained(target_dir: str, drafter: str | DFlashDraftModel, data_dir: str, *,
                         num_prompts: int = DEFAULT_HELD_OUT_PROMPTS, max_new_tokens: int = 64,
                         device: str = "cpu", held_out: Sequence[int] | None = None, dtype: str = "auto",
                         seed: int = 0, check_lossless: bool = False, batch_size: int = DEFAULT_BATCH_SIZE,
                         plain: bool | None = None) -> tuple[EvalReport, EvalReport]:
    """(untrained, trained) reports on the held-out prompts of ``data_dir`` with one loaded target.

    The untrained drafter has the trained one's config and a fresh initialisation from
    ``seed``. ``plain`` (default: only with ``check_lossless``) also decodes plainly, for the
    speedup; the embedded default's closing comparison needs tau alone. Print the pair with
    ``report.format_comparison``.
    """
    options = EvalOptions(max_new_tokens=max_new_tokens, batch_size=batch_size, check_lossless=check_lossless,
                          plain=check_lossless if plain is None else plain)
    untrained, trained = evaluate_sets(target_dir, drafter, data_dir=data_dir, num_prompts=num_prompts,
                                       held_out=held_out, device=device, dtype=dtype, vs_untrained=True, seed=seed,
                                       options=options)
    return untrained, trained
