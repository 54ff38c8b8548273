"""Attention of a few queries per row over that row's cached keys: a Triton kernel.

A decode step queries one token per row, a verify pass a block of them (16), each against the
keys of its own row up to its own length. The general path (ragged_attention.py
``gqa_attention``) runs SDPA over a boolean band mask: cuDNN's flash kernel, built for long
query blocks, took 11.4 us for one query over a few hundred keys at the Qwen3-1.7B shape on
an H200 (28 of them per step, plus the kernels that prepare its inputs), and it reads every
row's keys up to the span of the longest row (docs/benchmarks.md, "Decode and verify
attention"; ``python3 -m benchmarks.decode_attention`` times both). The kernel here gives each program one row and
one K/V head: the ``rep * q`` query rows that share that head (grouped-query attention folded
into the rows, as ``gqa_attention`` does) against the row's keys in blocks of ``BLOCK_T``, with
an online softmax in fp32. Where the rows alone fill the GPU (a batch of replies of mixed
lengths), a block that the mask hides from every query of the program is not read, so a row
reads its own keys and no further. Where programs are few (batch 1), a row's span is split
across programs of a few blocks each (flash-decoding: each block is a round trip to memory)
and the partial softmaxes are combined by a second kernel (one query) or, for a block of
queries, by the split that finishes last (a count per row and head: no second launch;
``$DFLASH_DECODE_ATTENTION_COMBINE=off``: by the second kernel there too; see
:func:`combine_in_kernel`).

The result is written as ``[B, q, Hq, D]``, the layout transformers' attention interface
returns, so no transpose copy follows. The op ``dflash::decode_attention`` is opaque to
torch.compile and recorded by CUDA graphs like any kernel. ``$DFLASH_DECODE_ATTENTION``:
``auto`` (the default: on CUDA where Triton imports) or ``off`` (SDPA over the mask);
ragged_attention.py ``hf_attention`` takes this path for the attention modules a
:class:`~dflash_ipc.decode.target.BatchedTarget` marks (:func:`mark_attention`), for bf16/fp16
inputs with at most ``MAX_ROWS`` query rows per K/V head and no softcapping or sinks.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from dflash_ipc.decode import pdl
from dflash_ipc.errors import ConfigError
from dflash_ipc.decode.matvec import HALF_DTYPES, SPLIT_BUFFERS, available, cuda_switch, num_sms, triton

if triton is not None:
    import triton.language as tl

    from dflash_ipc.decode.pdl import prefetch_l2, wait_for_inputs

ATTENTION_ENV = "DFLASH_DECODE_ATTENTION"
COMBINE_ENV = "DFLASH_DECODE_ATTENTION_COMBINE"
MARK = "dflash_decode_attention"
"""Attribute set on an attention module whose masked few-query calls take this kernel."""
MAX_ROWS = 128
"""Query rows per K/V head (``rep * q``) the kernel takes; more (a prefill) goes to SDPA."""
MAX_HEAD_DIM = 256
KEYS_PER_SPLIT = 64
"""Keys a program of a split span takes at the fewest (one block of ``BLOCK_T`` keys where
:func:`tile_plan` keeps 64; the span's last split may hold fewer): a program's blocks run one
after the other, each a round trip to memory, so at batch 1 short loops over many programs win
(64 against 128 on an H100, Qwen3-1.7B shape: docs/benchmarks.md, "The drafter's context beside
the verify"). ``$DFLASH_DECODE_ATTENTION_SPLIT_KEYS`` sets another count (at least 16)."""
SPLIT_KEYS_ENV = "DFLASH_DECODE_ATTENTION_SPLIT_KEYS"
BLOCK_T = 64
"""Keys per block (fewer where the tiles would not fit in shared memory: :func:`tile_plan`)."""
SHARED_BYTES = 160 * 1024
"""Shared memory the pipelined K/V tiles and the query tile may take (an H100/H200 SM has 228 KiB;
a margin for the layout conversions Triton adds)."""


def combine_in_kernel(device, queries: int) -> bool:
    """Whether the split span of a call with ``queries`` queries per row is combined by its last
    split (``$DFLASH_DECODE_ATTENTION_COMBINE`` auto, the default: for a block of queries, a
    verify pass or a drafted block) or by a second launch (one query, a decode step; or every
    call with ``off``). On one H200 at the Qwen3-1.7B shape the last split's combine kept a
    speculative cycle's time or took 1.7 % off it, and added 0.07-0.08 ms to a decode step of
    28 layers (docs/benchmarks.md, "Split spans combined")."""
    return queries > 1 and cuda_switch(COMBINE_ENV, device)


def enabled(device) -> bool:
    """Whether a target on ``device`` takes this kernel for its decode and verify attention."""
    return cuda_switch(ATTENTION_ENV, device) and available()


def mark_attention(layers) -> int:
    """Mark each decoder layer's ``self_attn`` (:data:`MARK`); how many were marked."""
    count = 0
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if attn is not None:
            setattr(attn, MARK, True)
            count += 1
    return count


def fits(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> bool:
    """Whether the kernel takes these shapes and dtypes: q ``[B, Hq, q, D]``, k ``[B, Hkv, T, D]``
    and v ``[B, Hkv, T, Dv]`` of one half dtype, Hq a multiple of Hkv, at most ``MAX_ROWS`` query
    rows per K/V head, head dims up to ``MAX_HEAD_DIM``, a bool mask ``[B, 1, q, >= T]``."""
    b, hq, nq, d = q.shape
    hkv, span = k.shape[1], k.shape[2]
    return (q.dtype in HALF_DTYPES and k.dtype == q.dtype and v.dtype == q.dtype
            and k.shape[0] == b and tuple(v.shape[:3]) == tuple(k.shape[:3]) and k.shape[-1] == d
            and hq % hkv == 0 and hq // hkv * nq <= MAX_ROWS and max(d, v.shape[-1]) <= MAX_HEAD_DIM
            and mask.dim() == 4 and mask.dtype == torch.bool and tuple(mask.shape[:3]) == (b, 1, nq)
            and mask.shape[3] >= span)


def applies(module, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> bool:
    """Whether ``hf_attention``'s call goes to the kernel: a module :func:`mark_attention` marked,
    CUDA tensors that :func:`fits`."""
    return getattr(module, MARK, False) and q.is_cuda and fits(q, k, v, mask)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def keys_per_split() -> int:
    """:data:`KEYS_PER_SPLIT`, or ``$DFLASH_DECODE_ATTENTION_SPLIT_KEYS`` where set."""
    value = os.environ.get(SPLIT_KEYS_ENV)
    if not value:
        return KEYS_PER_SPLIT
    if not value.isdigit() or int(value) < 16:
        raise ConfigError(f"${SPLIT_KEYS_ENV}={value!r}: keys per split, an integer of at least 16")
    return int(value)


def split_plan(programs: int, span: int, sms: int, block_t: int, splits: int | None = None) -> tuple[int, int]:
    """(splits, key blocks per split) of a span of ``span`` keys in blocks of ``block_t``, for
    ``programs`` (row, K/V head) pairs: ``splits`` asked for, else about one program per SM in
    all with :func:`keys_per_split` keys or more each (the last split may hold fewer); then as
    few splits as hold those blocks, so that none is left empty."""
    if splits is None:
        splits = max(1, min(_cdiv(span, keys_per_split()), _cdiv(sms, programs)))
    blocks = max(1, _cdiv(_cdiv(span, block_t), splits))
    return max(1, _cdiv(_cdiv(span, block_t), blocks)), blocks


def tile_plan(block_m: int, block_d: int, block_dv: int, block_t: int, skip: bool) -> tuple[int, int, int]:
    """(keys per block, pipeline stages, warps) for a program's query tile ``block_m`` x
    ``block_d`` and K/V tiles of ``block_t`` keys: the stages (3, 2 where the loop tests for hidden
    blocks) and then the block shrunk until the query tile and the staged K/V tiles fit in
    SHARED_BYTES (128 query rows at head dim 256 take a 64-KiB query tile)."""
    warps = 4 if block_m * max(block_d, block_dv) <= 32 * 128 else 8
    stages = 2 if skip else 3

    def shared(t: int, n: int) -> int:
        return 2 * (block_m * block_d + n * t * (block_d + block_dv))
    while stages > 2 and shared(block_t, stages) > SHARED_BYTES:
        stages -= 1
    while block_t > 16 and shared(block_t, stages) > SHARED_BYTES:
        block_t //= 2
    return block_t, stages, warps


if triton is not None:
    @triton.jit
    def _attend_block(q, k_base, v_base, t, t_ok, d, dv, seen, m_i, l_i, acc, sk_t, sv_t, scale,
                      D: tl.constexpr, DV: tl.constexpr):
        """One block of keys ``t`` into the online softmax (m_i, l_i, acc) of the rows ``q``."""
        k = tl.load(k_base + t[:, None].to(tl.int64) * sk_t + d[None, :], mask=t_ok[:, None] & (d[None, :] < D),
                    other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet stay 0
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vv = tl.load(v_base + t[:, None].to(tl.int64) * sv_t + dv[None, :], mask=t_ok[:, None] & (dv[None, :] < DV),
                     other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv)
        return m_new, l_i, acc

    @triton.jit
    def _attention_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, part_ptr, stat_ptr, count_ptr,
                          sq_b, sq_h, sq_q, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sm_b, sm_q, sm_t,
                          so_b, so_q, so_h, T, blocks_per_split, scale,
                          HKV: tl.constexpr, REP: tl.constexpr, NQ: tl.constexpr, D: tl.constexpr,
                          DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, SPLIT: tl.constexpr,
                          SKIP_HIDDEN: tl.constexpr, COMBINE_LAST: tl.constexpr = False, SPLIT_P2: tl.constexpr = 1,
                          PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0, PREFETCH_LINES: tl.constexpr = 1):
        """Rows ``r`` = (query head ``h * REP + r // NQ``, query ``r % NQ``) of one (row b, K/V
        head h) against keys of split ``program_id(1)``; the finished output, or (SPLIT) the
        unnormalised sums and their softmax max and mass for the combine. COMBINE_LAST: each split
        counts itself in ``count[pid]`` once its sums are stored, and the split that counts last
        combines them all and sets the count back to 0 (matvec.py's ``_rows_kernel`` does the
        same with its K splits): one launch, and no memset before the next one. PREFETCH: the span's
        first keys whose K and V rows (PREFETCH_LINES lines each) are asked of L2 before the wait
        (pdl.py), 0: none."""
        pid = tl.program_id(0)
        split = tl.program_id(1)
        b = (pid // HKV).to(tl.int64)
        h = pid % HKV
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < REP * NQ
        head = h * REP + rows // NQ
        qi = rows % NQ
        d = tl.arange(0, BLOCK_D)
        dv = tl.arange(0, BLOCK_DV)
        if PREFETCH > 0:  # 64 elements a line (2-byte K and V), clamped inside the rows and the span
            ahead = tl.minimum(split * blocks_per_split * BLOCK_T + tl.arange(0, PREFETCH), T - 1).to(tl.int64)
            line = tl.arange(0, PREFETCH_LINES) * 64
            prefetch_l2(k_ptr + b * sk_b + h * sk_h + ahead[:, None] * sk_t + tl.minimum(line, D - 1)[None, :])
            prefetch_l2(v_ptr + b * sv_b + h * sv_h + ahead[:, None] * sv_t + tl.minimum(line, DV - 1)[None, :])
        wait_for_inputs(PDL)  # pdl.py
        q = tl.load(q_ptr + b * sq_b + head[:, None] * sq_h + qi[:, None] * sq_q + d[None, :],
                    mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
        k_base = k_ptr + b * sk_b + h * sk_h
        v_base = v_ptr + b * sv_b + h * sv_h
        m_base = mask_ptr + b * sm_b + qi[:, None] * sm_q
        t_start = split * blocks_per_split * BLOCK_T
        t_end = tl.minimum(T, t_start + blocks_per_split * BLOCK_T)
        for t0 in range(t_start, t_end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            t_ok = t < t_end
            seen = tl.load(m_base + t[None, :].to(tl.int64) * sm_t, mask=row_ok[:, None] & t_ok[None, :], other=0) != 0
            if SKIP_HIDDEN:
                if tl.max(seen.to(tl.int32)) > 0:  # a block no query of ours sees is not read
                    m_i, l_i, acc = _attend_block(q, k_base, v_base, t, t_ok, d, dv, seen, m_i, l_i, acc, sk_t,
                                                  sv_t, scale, D, DV)
            else:  # no branch: the loop's loads are pipelined
                m_i, l_i, acc = _attend_block(q, k_base, v_base, t, t_ok, d, dv, seen, m_i, l_i, acc, sk_t,
                                              sv_t, scale, D, DV)
        if SPLIT:
            n_split = tl.num_programs(1)
            base = (pid * n_split + split).to(tl.int64) * BLOCK_M
            tl.store(part_ptr + (base + rows[:, None]) * BLOCK_DV + dv[None, :], acc)
            tl.store(stat_ptr + (base + rows) * 2, m_i)
            tl.store(stat_ptr + (base + rows) * 2 + 1, l_i)
            if COMBINE_LAST:
                # Every thread's store done before the count: a barrier, then a release at GPU scope
                # (the acquire half orders the last split's loads after the others' stores).
                tl.debug_barrier()
                done = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu")
                if done == n_split - 1:  # the last split of this (row, K/V head): the others' sums are stored
                    _combine_splits(part_ptr, stat_ptr, out_ptr, pid, n_split, so_b, so_q, so_h, HKV, REP, NQ, DV,
                                    BLOCK_M, BLOCK_DV, SPLIT_P2, ".cg")
                    tl.atomic_xchg(count_ptr + pid, 0)
        else:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + b * so_b + qi[:, None] * so_q + head[:, None] * so_h + dv[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))

    @triton.jit
    def _combine_splits(part_ptr, stat_ptr, out_ptr, pid, n_split, so_b, so_q, so_h, HKV: tl.constexpr,
                        REP: tl.constexpr, NQ: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_DV: tl.constexpr, SPLIT_P2: tl.constexpr, CACHE: tl.constexpr):
        """The ``n_split`` (<= SPLIT_P2) partial softmaxes of (row, K/V head) ``pid``, rescaled to
        their common max and summed into the output. Latency is the cost here: every split's max
        and mass come in one load, and the sums' loads four at a time, issued together (loads
        with cache modifier ``CACHE``: ".cg" reads past this SM's L1, where another SM's stores
        are). Measured up to 16 splits; more (few K/V heads at batch 1 over long spans) hold
        ``[SPLIT_P2, BLOCK_M]`` tiles and take a masked reduction per split."""
        b = (pid // HKV).to(tl.int64)
        h = pid % HKV
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < REP * NQ
        dv = tl.arange(0, BLOCK_DV)
        splits = tl.arange(0, SPLIT_P2)
        split_ok = splits < n_split
        stats = stat_ptr + ((pid * n_split + splits).to(tl.int64)[:, None] * BLOCK_M + rows[None, :]) * 2
        m_s = tl.load(stats, mask=split_ok[:, None], other=float("-inf"), cache_modifier=CACHE)  # [S, M]
        l_s = tl.load(stats + 1, mask=split_ok[:, None], other=0.0, cache_modifier=CACHE)
        m = tl.max(m_s, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(m_s - m_safe[None, :])  # 0 for the splits past n_split
        l_sum = tl.sum(w * l_s, 0)
        acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
        tile = rows[:, None] * BLOCK_DV + dv[None, :]
        for s0 in range(0, n_split, 4):
            for j in tl.static_range(4):
                s = s0 + j
                w_s = tl.sum(tl.where(splits[:, None] == s, w, 0.0), 0)  # [M]: row s of w
                part = tl.load(part_ptr + (pid * n_split + s).to(tl.int64) * (BLOCK_M * BLOCK_DV) + tile,
                               mask=(tile >= 0) & (s < n_split), other=0.0, cache_modifier=CACHE)
                acc += w_s[:, None] * part
        out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
        head = h * REP + rows // NQ
        qi = rows % NQ
        tl.store(out_ptr + b * so_b + qi[:, None] * so_q + head[:, None] * so_h + dv[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))

    @triton.jit
    def _combine_kernel(part_ptr, stat_ptr, out_ptr, n_split, so_b, so_q, so_h,
                        HKV: tl.constexpr, REP: tl.constexpr, NQ: tl.constexpr, DV: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, SPLIT_P2: tl.constexpr,
                        PDL: tl.constexpr = False):
        """:func:`_combine_splits` in a launch of its own, a program per (row, K/V head)."""
        wait_for_inputs(PDL)  # pdl.py
        _combine_splits(part_ptr, stat_ptr, out_ptr, tl.program_id(0), n_split, so_b, so_q, so_h, HKV, REP, NQ, DV,
                        BLOCK_M, BLOCK_DV, SPLIT_P2, "")


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


def triton_decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None, *,
                            splits: int | None = None, block_t: int = BLOCK_T,
                            combine_last: bool | None = None) -> Tensor:
    """q ``[B, Hq, q, D]``, k ``[B, Hkv, T, D]``, v ``[B, Hkv, T, Dv]`` (any strides, the last
    dimension contiguous), mask ``[B, 1, q, >=T]`` bool -> ``[B, q, Hq, Dv]``: query head h uses
    K/V head ``h // rep`` (``gqa_attention``'s order); a query that sees no key gets zeros.
    ``splits``: programs per (row, K/V head) along the keys (None: :func:`split_plan`'s);
    ``combine_last``: split spans combined by their last program, not a second launch (None:
    :func:`combine_in_kernel`)."""
    if not fits(q, k, v, mask):
        raise ValueError(f"decode_attention: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, "
                         f"v {tuple(v.shape)} {v.dtype}, mask {tuple(mask.shape)} {mask.dtype} (see fits)")
    bsz, hq, nq, dim = q.shape
    hkv, span, dim_v = k.shape[1], k.shape[2], v.shape[-1]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    rep = hq // hkv
    block_m = _pow2(rep * nq)
    block_d, block_dv = _pow2(dim), _pow2(dim_v)
    programs = bsz * hkv
    sms = num_sms(q.device.index or 0) if q.is_cuda else 132
    # Rows that fill the GPU by themselves (a batch of replies of mixed lengths) skip the key
    # blocks their queries do not see: the reads are the cost. With few rows (batch 1) the
    # latency of each block is, and a loop without the test pipelines its loads.
    skip = programs >= sms
    block_t, stages, warps = tile_plan(block_m, block_d, block_dv, block_t, skip)
    splits, blocks = split_plan(programs, span, sms, block_t, splits)
    out = torch.empty(bsz, nq, hq, dim_v, dtype=q.dtype, device=q.device)
    seen = mask.view(torch.uint8)
    combine_last = splits > 1 and (combine_in_kernel(q.device, nq) if combine_last is None else combine_last)
    if splits > 1:
        part = torch.empty(programs * splits * block_m * block_dv, dtype=torch.float32, device=q.device)
        stat = torch.empty(programs * splits * block_m * 2, dtype=torch.float32, device=q.device)
    else:
        part = stat = out  # pointers the kernel does not touch without SPLIT
    count = SPLIT_BUFFERS.get(q.device, 0, programs)[1] if combine_last else out  # untouched without
    # K/V ahead of the wait (pdl.py) where every key block is read: with SKIP_HIDDEN most are not
    # (a split's keys past the span are clamped to its last: no variant per span)
    ahead, lines = (0, 1) if skip or span == 0 else pdl.prefetch_tokens(blocks * block_t,
                                                                        max(dim, dim_v) * k.element_size(), q.device)
    _attention_kernel[(programs, splits)](
        q, k, v, seen, out, part, stat, count, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), seen.stride(0), seen.stride(2), seen.stride(3),
        out.stride(0), out.stride(1), out.stride(2), span, blocks,
        float(scale if scale is not None else dim ** -0.5),
        HKV=hkv, REP=rep, NQ=nq, D=dim, DV=dim_v, BLOCK_M=block_m, BLOCK_T=block_t, BLOCK_D=block_d,
        BLOCK_DV=block_dv, SPLIT=splits > 1, SKIP_HIDDEN=skip, COMBINE_LAST=combine_last,
        SPLIT_P2=_pow2(splits, least=2) if combine_last else 1,  # unused without: no variant per split count
        PREFETCH=ahead, PREFETCH_LINES=lines, num_warps=warps, num_stages=stages, **pdl.launch_args(q.device))
    if splits > 1 and not combine_last:
        _combine_kernel[(programs,)](part, stat, out, splits, out.stride(0), out.stride(1), out.stride(2),
                                     HKV=hkv, REP=rep, NQ=nq, DV=dim_v, BLOCK_M=block_m, BLOCK_DV=block_dv,
                                     SPLIT_P2=_pow2(splits, least=2), num_warps=4, **pdl.launch_args(q.device))
    return out


@torch.library.custom_op("dflash::decode_attention", mutates_args=())
def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """``gqa_attention(q, k, v, mask, scale).transpose(1, 2)`` by the Triton kernel (CUDA only)."""
    return triton_decode_attention(q, k, v, mask, scale)


@decode_attention.register_fake
def _decode_attention_shape(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1], v.shape[-1]))
