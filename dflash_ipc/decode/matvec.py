"""The decode step's linear layers at a few rows: Triton kernels that stream each weight once.

At batch 1 every linear layer of a decode step is a matrix-vector product, and a verify pass
(a block of 16 tokens) or a drafted block is a product of at most 16 rows: the weight is read
once for those rows, so the step is bound by how fast the weights stream. cuBLAS runs these
products as split-K GEMM tiles (``nvjet_sm90_tst_64x8`` and the like) that stream them at
1.5-2.7 TB/s at the Qwen3-1.7B shape on an H200, below 0.4 TB/s for its 4-MB k/v weights
(docs/benchmarks.md, "Batch 1: a matrix-vector kernel, fused projections"). The kernels here
give each program ``BLOCK_N`` whole rows of the weight and stream their contiguous K once:

    one row      per-lane partial sums in fp32, reduced once at the end (no second pass over
                 split-K partials): ``_matvec_kernel``;
    2..MAX_ROWS  the rows padded to 16 and multiplied on the tensor cores (``tl.dot``, fp32
                 accumulation), each weight tile read once for all of them: ``_rows_kernel``.

The one-row kernel takes a prologue and an epilogue (flags, see the kernels), the few-row kernel
the epilogue with its prologue launched just before it (``_rows_norm_kernel``): decode/fused_layer.py
uses them to run a decoder layer's norms, residual adds and silu * up with its products.

:func:`route_matvec` swaps a model's ``nn.Linear`` modules for :class:`MatVecLinear`, which
sends a bf16/fp16 CUDA input of at most ``MAX_ROWS`` rows through the custom op
``dflash::matvec_linear`` (:func:`takes` says which inputs); the op is opaque to
torch.compile, so a compiled decode layer calls it as it would cuBLAS, and a CUDA graph
records its launch. Where Triton is missing (CPU builds of torch) nothing is swapped.
``$DFLASH_DECODE_GEMV``: ``auto`` (the default: on CUDA where Triton imports) or ``off``.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_ipc.decode import pdl, rows_configs
from dflash_ipc.errors import ConfigError

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch ship without Triton; nothing here is used there
    triton = None

HALF_DTYPES = (torch.bfloat16, torch.float16)
"""Input dtypes the kernel takes (a float32 target keeps cuBLAS: its decode is not the fast path)."""
GEMV_ENV = "DFLASH_DECODE_GEMV"
SETTINGS = ("auto", "off")
MAX_ROWS = 16
"""Rows a product takes the kernels for (a verify block of 16 at batch 1); more go to cuBLAS,
whose tiles share each weight read among many rows."""
MAX_ROWS_ENV = "DFLASH_DECODE_GEMV_MAX_ROWS"
"""Fewer rows for the kernels (1..MAX_ROWS; 1: the matrix-vector kernel alone, cuBLAS from two
rows on), for a GPU where the few-row kernel loses to cuBLAS (benchmarks/matvec.py --rows)."""
DOT_ROWS = 16  # tl.dot's smallest operand dimension: fewer rows are padded (masked loads, not copies)


def available() -> bool:
    """Whether the kernel can run here (Triton imports and a CUDA device is present)."""
    return triton is not None and torch.cuda.is_available()


def cuda_switch(env: str, device) -> bool:
    """A decode switch read from ``$env`` (SETTINGS; unset: auto): on for a CUDA ``device`` unless off."""
    setting = os.environ.get(env) or "auto"
    if setting not in SETTINGS:
        raise ConfigError(f"${env}={setting!r}; allowed: {list(SETTINGS)}")
    return setting == "auto" and torch.device(device).type == "cuda"


def enabled(device) -> bool:
    """Whether a target on ``device`` routes its linears of a few rows here ($DFLASH_DECODE_GEMV)."""
    return cuda_switch(GEMV_ENV, device) and available()


if triton is not None:
    from dflash_ipc.decode.pdl import wait_for_inputs

    # The kernels' optional prologue and epilogue: what a decoder layer does around its products
    # (decode/fused_layer.py), so that a decode step runs them in the product's launch rather
    # than in kernels of their own. Each rounds to the activations' dtype where the eager layer
    # does (a bf16 tensor between two ops), so only the sums' order differs from the eager path:
    #   ADD       the input is x + add (the attention's output plus the residual stream), and
    #             that sum is stored to h (the residual of the next product)
    #   NORM      the input is RMS-normalised, then times the norm's weight g (Llama's RMSNorm:
    #             fp32 mean of squares, x * rsqrt(mean + eps) cast, then g * it)
    #   GLU       the weight is gate rows [0, N) over up rows [N, 2N): y = silu(gate) * up
    #   RESIDUAL  y = product + res (the residual stream after the layer's last product)
    # The one-row kernel runs ADD and NORM in each program (its row is one load); for more rows
    # they run before the product, once per row (_rows_norm_kernel).

    @triton.jit
    def _one_row_rstd(x_ptr, add_ptr, h_ptr, K, eps, store_h, ADD: tl.constexpr, BLOCK_K: tl.constexpr):
        """rsqrt(mean(x^2) + eps) of the row x (+ add, stored to h by the program that has
        ``store_h``), in fp32."""
        offs_k = tl.arange(0, BLOCK_K)
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + offs_k < K
            x = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            if ADD:
                x = (x + tl.load(add_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)).to(h_ptr.dtype.element_ty)
                tl.store(h_ptr + k0 + offs_k, x, mask=k_ok & store_h)
                x = x.to(tl.float32)
            squares += x * x
        return tl.math.rsqrt(tl.sum(squares, axis=0) / K + eps)

    @triton.jit
    def _rows_norm_kernel(x_ptr, add_ptr, g_ptr, h_ptr, out_ptr, K, stride_xm, eps, ADD: tl.constexpr,
                          BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
        """The few-row kernel's ADD and NORM prologue, once for row ``program_id(0)`` rather than
        in every program of the product: x (+ add, stored to h) RMS-normalised and times g into
        out, each step rounded as :func:`_input_tile` rounds it; add, h and out are ``[M, K]``
        contiguous."""
        m = tl.program_id(0)
        offs_k = tl.arange(0, BLOCK_K)
        dtype = out_ptr.dtype.element_ty
        wait_for_inputs(PDL)
        rstd = _one_row_rstd(x_ptr + m * stride_xm, add_ptr + m * K, h_ptr + m * K, K, eps, True, ADD, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):  # again (from L1/L2): a row of up to BLOCK_K keys is one pass each
            ok = k0 + offs_k < K
            x = tl.load(x_ptr + m * stride_xm + k0 + offs_k, mask=ok, other=0.0).to(tl.float32)
            x = _input_tile(x, add_ptr + m * K + k0 + offs_k, g_ptr + k0 + offs_k, rstd, ok, dtype, ADD, True)
            tl.store(out_ptr + m * K + k0 + offs_k, x.to(dtype), mask=ok)

    @triton.jit
    def _input_tile(x, add_ptrs, g_ptrs, rstd, ok, dtype: tl.constexpr, ADD: tl.constexpr, NORM: tl.constexpr):
        """The product's input tile from the loaded x (fp32): + add, normalised, times g, each
        step rounded to the activations' ``dtype`` as the eager layer's tensors are."""
        if ADD:
            x = (x + tl.load(add_ptrs, mask=ok, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        if NORM:
            x = (x * rstd).to(dtype).to(tl.float32)
            x = (tl.load(g_ptrs, mask=ok, other=0.0).to(tl.float32) * x).to(dtype).to(tl.float32)
        return x

    @triton.jit
    def _output(y, up, b_ptrs, res_ptrs, out_ok, dtype: tl.constexpr, HAS_BIAS: tl.constexpr, GLU: tl.constexpr,
                RESIDUAL: tl.constexpr):
        """The product's sums y (and the up half's, under GLU) as the layer's output, fp32;
        ``b_ptrs`` and ``res_ptrs`` shaped as y is."""
        if HAS_BIAS:
            y += tl.load(b_ptrs, mask=out_ok, other=0.0).to(tl.float32)
        if GLU:  # silu(gate) * up as torch computes silu: x / (1 + exp(-x)) in fp32, rounded
            gate = y.to(dtype).to(tl.float32)
            y = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)
        if RESIDUAL:
            y = y.to(dtype).to(tl.float32) + tl.load(res_ptrs, mask=out_ok, other=0.0).to(tl.float32)
        return y

    @triton.jit
    def _matvec_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, add_ptr, g_ptr, h_ptr, res_ptr, eps, up_off,
                       HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                       ADD: tl.constexpr = False, NORM: tl.constexpr = False, GLU: tl.constexpr = False,
                       RESIDUAL: tl.constexpr = False, RSTD_BLOCK: tl.constexpr = 16, PDL: tl.constexpr = False):
        """y[n] = sum_k x[k] w[n, k] (+ b[n]) for this program's BLOCK_N rows n of w [N, K] (with
        GLU, of w [2N, K], the up rows ``up_off`` = N * K elements on); the flags above; PDL: pdl.py."""
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        dtype = y_ptr.dtype.element_ty
        wait_for_inputs(PDL)
        rstd = 1.0
        if NORM:
            rstd = _one_row_rstd(x_ptr, add_ptr, h_ptr, K, eps, pid == 0, ADD, RSTD_BLOCK)
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # per-lane partial sums: one reduction, at the end
        acc_up = acc
        if GLU:
            acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + offs_k < K
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
                if GLU:
                    w_up = tl.load(w_ptrs + up_off, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
                x = tl.load(x_ptr + k0 + offs_k)
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
                if GLU:
                    w_up = tl.load(w_ptrs + up_off, mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                                   eviction_policy="evict_first")
                x = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0)
            x = _input_tile(x.to(tl.float32), add_ptr + k0 + offs_k, g_ptr + k0 + offs_k, rstd, k_ok, dtype, ADD,
                            NORM)
            acc += w.to(tl.float32) * x[None, :]
            if GLU:
                acc_up += w_up.to(tl.float32) * x[None, :]
            w_ptrs += BLOCK_K
        y = _output(tl.sum(acc, axis=1), tl.sum(acc_up, axis=1), b_ptr + offs_n, res_ptr + offs_n, n_ok, dtype,
                    HAS_BIAS, GLU, RESIDUAL)
        tl.store(y_ptr + offs_n, y.to(dtype), mask=n_ok)

    @triton.jit
    def _rows_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, k_per_split, stride_xm, stride_ym,
                     res_ptr, up_off, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, GLU: tl.constexpr = False,
                     RESIDUAL: tl.constexpr = False, PDL: tl.constexpr = False):
        """y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) for M <= DOT_ROWS rows m and this program's
        BLOCK_N rows n of w [N, K], over its split of K (program_id 1; ``k_per_split`` keys, a
        multiple of BLOCK_K): each tile of w read once, on the tensor cores for all rows. With
        SPLIT > 1 each split leaves its fp32 sums in ``part`` and counts itself in ``count[n
        block]``; the split that counts last sums them, writes y and sets the count back to 0
        (so one launch, and no memset before the next one, in a CUDA graph or not). The epilogue
        flags above (GLU with one split only; res contiguous); the prologue's norm runs before, in
        :func:`_rows_norm_kernel`. PDL: pdl.py."""
        pid_n, split = tl.program_id(0), tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_m = tl.arange(0, 16)  # DOT_ROWS
        m_ok = offs_m < M
        dtype = y_ptr.dtype.element_ty
        k_lo = split * k_per_split
        wait_for_inputs(PDL)
        offs_k = k_lo + tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
        acc_up = acc
        if GLU:
            acc_up = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
        for k0 in range(k_lo, tl.minimum(K, k_lo + k_per_split), BLOCK_K):
            k_ok = offs_k < K  # offs_k: this step's keys
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
                if GLU:
                    w_up = tl.load(w_ptrs + up_off, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
                if GLU:
                    w_up = tl.load(w_ptrs + up_off, mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                                   eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(w, tl.trans(x), acc)  # [BLOCK_N, 16]: fp32 accumulation
            if GLU:
                acc_up = tl.dot(w_up, tl.trans(x), acc_up)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            offs_k += BLOCK_K
        y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
        res_ptrs = res_ptr + offs_m[None, :] * N + offs_n[:, None]
        b_ptrs = b_ptr + offs_n[:, None] + 0 * offs_m[None, :]
        out_ok = n_ok[:, None] & m_ok[None, :]
        if SPLIT == 1:
            y = _output(acc, acc_up, b_ptrs, res_ptrs, out_ok, dtype, HAS_BIAS, GLU, RESIDUAL)
            tl.store(y_ptrs, y.to(dtype), mask=out_ok)
        else:
            tile = tl.arange(0, BLOCK_N)[:, None] * 16 + offs_m[None, :]
            part = part_ptr + (pid_n * SPLIT).to(tl.int64) * (BLOCK_N * 16) + tile
            tl.store(part + split * (BLOCK_N * 16), acc)
            # Every thread's store done before the count: a barrier, then a release at GPU scope
            # (the acquire half orders the last split's loads after the others' stores).
            tl.debug_barrier()
            done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT - 1:  # the last split of this block of n: the others' sums are in part
                total = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
                for other in range(0, SPLIT):
                    total += tl.load(part + other * (BLOCK_N * 16), cache_modifier=".cg")
                y = _output(total, total, b_ptrs, res_ptrs, out_ok, dtype, HAS_BIAS, False, RESIDUAL)
                tl.store(y_ptrs, y.to(dtype), mask=out_ok)
                tl.atomic_xchg(count_ptr + pid_n, 0)


def launch_config(n: int, k: int) -> dict:
    """Block sizes, warps and pipeline stages against an N x K weight: the best of
    benchmarks/matvec.py's sweep on an H200 for the Qwen3-1.7B and -8B layers, by N (a few hundred
    programs or more for 132 SMs; wide blocks of K where N gives few rows)."""
    if n <= 2048:
        return dict(BLOCK_N=4, BLOCK_K=1024, num_warps=8, num_stages=4)
    if n <= 4096:
        return dict(BLOCK_N=4, BLOCK_K=512, num_warps=4, num_stages=4)
    if n <= 8192:
        return dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=2)
    return dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=4)


def triton_matvec(x: Tensor, weight: Tensor, bias: Tensor | None = None, config: dict | None = None, *,
                  add: Tensor | None = None, norm: Tensor | None = None, eps: float = 0.0, h: Tensor | None = None,
                  residual: Tensor | None = None, glu: bool = False) -> Tensor:
    """``F.linear(x, weight, bias)`` by the Triton kernel for x of one row (``[..., K]`` with
    every leading size 1), weight ``[N, K]``, bias ``[N]``; fp32 sums, x's dtype out. The
    kernels' prologue and epilogue (see the kernels): ``add`` (x's shape; with ``norm``, and
    ``h`` that receives x + add), ``norm`` (the RMS norm's weight ``[K]``, its ``eps``), ``glu``
    (weight ``[2N, K]``, gate over up: N outputs), ``residual`` (the output's shape)."""
    k = x.shape[-1]
    if x.numel() != k or weight.shape[1] != k:
        raise ValueError(f"triton_matvec: x {tuple(x.shape)} against weight {tuple(weight.shape)} "
                         f"(one row of the weight's K)")
    x1 = x.reshape(k).contiguous()
    weight = weight if weight.is_contiguous() else weight.contiguous()
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    cfg = dict(config or launch_config(weight.shape[0], k))
    if glu:  # each program reads its BLOCK_N rows of gate and as many of up: the same bytes as unfused
        cfg["BLOCK_N"] = max(1, cfg["BLOCK_N"] // 2)
    fusion = _fusion_args(x1, n, add, norm, h, residual, glu, ONE_ROW_RSTD_BLOCK, bias)
    b = bias if bias is not None else weight  # a pointer the kernel does not read without HAS_BIAS
    _matvec_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](x1, weight, b, y, n, k, *fusion["tensors"], eps, n * k,
                                                      HAS_BIAS=bias is not None, EVEN_K=k % cfg["BLOCK_K"] == 0,
                                                      **fusion["flags"], **cfg,
                                                      **pdl.launch_args(x.device))
    return y.reshape(*x.shape[:-1], n)


ONE_ROW_RSTD_BLOCK = 4096
"""Keys per load of the one-row NORM prologue's sum of squares: a hidden size of up to 4,096 in
one load (every program sums the whole row before its product starts: latency, not bandwidth)."""
ROWS_NORM_BLOCK = 4096
"""Keys per load of the few-row kernel's norm (:func:`_rows_norm_kernel`, a program per row)."""


def _fusion_args(x: Tensor, n: int, add, norm, h, residual, glu: bool, rstd_block: int, bias=None) -> dict:
    """The kernels' prologue/epilogue tensors (add, g, h, res: x where a flag is off, a pointer
    the kernel does not read) and flags, checked against x's ``[M, K]`` or ``[K]`` and N outputs."""
    rows, k = (1, x.shape[0]) if x.dim() == 1 else x.shape
    if add is not None and (norm is None or h is None):
        raise ValueError("matvec kernels: add needs norm and h (the sum is the norm's input and the next residual)")
    if glu and bias is not None:
        raise ValueError("matvec kernels: glu takes no bias (it would reach the gate half only)")
    for name, t, numel in (("add", add, rows * k), ("h", h, rows * k), ("norm", norm, k),
                           ("residual", residual, rows * n)):
        if t is not None and (t.numel() != numel or not t.is_contiguous() or t.dtype != x.dtype
                              or t.device != x.device):
            raise ValueError(f"matvec kernels: {name} {tuple(t.shape)} {t.dtype} must be contiguous, of {numel} "
                             f"elements, {x.dtype} on {x.device}")
    if h is not None and any(_overlap(h, t) for t in (x, add) if t is not None):
        raise ValueError("matvec kernels: h shares memory with x or add (the kernels read both after writing h)")
    tensors = [t if t is not None else x for t in (add, norm, h, residual)]
    flags = dict(ADD=add is not None, NORM=norm is not None, GLU=glu, RESIDUAL=residual is not None,
                 RSTD_BLOCK=min(rstd_block, triton.next_power_of_2(k)) if norm is not None else 16)
    return {"tensors": tensors, "flags": flags}


def _overlap(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors' element ranges in memory overlap (same device)."""
    lo_a, lo_b = a.data_ptr(), b.data_ptr()
    return (a.device == b.device and lo_a < lo_b + b.numel() * b.element_size()
            and lo_b < lo_a + a.numel() * a.element_size())


def rows_config(n: int, k: int, sms: int = 132, *, glu: bool = False, device_name: str = "") -> dict:
    """The few-row kernel's launch config against an N x K weight: decode/rows_configs.py."""
    return rows_configs.rows_config(n, k, sms, glu=glu, device_name=device_name)


class SplitBuffers:
    """Per device, the few-row kernel's split partial sums (fp32) and per-block counts (int32,
    zero between launches: the last split of a block resets its count). Launches on one stream
    share them (a decode step's kernels run one after another), and so do the streams that never
    run at once (the current stream, a graph's capture stream, its warm-up's stream); a stream
    whose kernels run beside them (the drafter's context appended beside a verify pass,
    eval/overlapped_append.py) has buffers of its own, made by :meth:`own` before any capture
    (counts made in a capture are zeroed again at every later call until one runs outside a
    capture, below, which a capture stream's never does). A buffer too small for a launch
    is replaced by a larger one, and the old one is kept: a CUDA graph that recorded a launch
    still writes to it. The first ones (4 MiB, 64 KiB) hold every launch of the rule's configs
    (rows_configs.py: split only below ROWS_SPLIT_BELOW blocks); other configs (a table's, a
    sweep's) may grow them.
    Counts made during a CUDA graph capture are zeroed only when that graph replays, so every
    later call zeroes them again before its launch (recorded into its own graph if captured)
    until one runs outside a capture. decode_attention.py's kernel takes its counts from here
    too (a count per row and K/V head, reset by the split that combines), on the same stream."""

    def __init__(self) -> None:
        self._by_stream: dict[tuple[torch.device, int], tuple[Tensor, Tensor]] = {}
        self._kept: list[Tensor] = []
        self._unzeroed: set[tuple[torch.device, int]] = set()
        self._own_streams: set[int] = set()

    def own(self, device: torch.device, stream: torch.cuda.Stream) -> None:
        """Buffers of its own for ``stream`` on ``device`` (whose kernels run beside the others'),
        made now: outside a capture, so its counts start zeroed."""
        self._own_streams.add(stream.cuda_stream)
        with torch.cuda.stream(stream):
            self.get(device, 0, 0, capturing=False)
        stream.synchronize()

    def _key(self, device: torch.device) -> tuple[torch.device, int]:
        if device.type != "cuda" or not self._own_streams:
            return device, 0
        stream = torch.cuda.current_stream(device).cuda_stream
        return device, stream if stream in self._own_streams else 0

    def get(self, device: torch.device, part_floats: int, counts: int,
            capturing: bool | None = None) -> tuple[Tensor, Tensor]:
        """Buffers of at least ``part_floats`` and ``counts`` on ``device`` for its current stream
        (``capturing``: a CUDA graph capture is in progress; None: ask CUDA)."""
        key = self._key(device)
        part, count = self._by_stream.get(key, (None, None))
        if capturing is None:
            capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if part is None or part.numel() < part_floats:
            self._kept += [part] if part is not None else []
            part = torch.empty(max(part_floats, 1 << 20), dtype=torch.float32, device=device)
        if count is None or count.numel() < counts:
            self._kept += [count] if count is not None else []
            count = torch.zeros(max(counts, 1 << 14), dtype=torch.int32, device=device)
            if capturing:
                self._unzeroed.add(key)
        elif key in self._unzeroed:  # zeroed now, or (captured) when this graph replays
            count.zero_()
            if not capturing:
                self._unzeroed.discard(key)
        self._by_stream[key] = (part, count)
        return part, count


SPLIT_BUFFERS = SplitBuffers()


def triton_rows(x: Tensor, weight: Tensor, bias: Tensor | None = None, config: dict | None = None, *,
                add: Tensor | None = None, norm: Tensor | None = None, eps: float = 0.0, h: Tensor | None = None,
                residual: Tensor | None = None, glu: bool = False) -> Tensor:
    """``F.linear(x, weight, bias)`` by the few-row kernel for x of ``M <= MAX_ROWS`` rows
    (``[..., K]``), weight ``[N, K]``, bias ``[N]``; fp32 sums, x's dtype out. The prologue and
    epilogue arguments are :func:`triton_matvec`'s, for every row (GLU runs K unsplit). The
    prologue (add, norm) runs first in a launch of its own, a program per row: inside the
    product every program would norm all rows for itself, which took 12 us more than the product
    at the Qwen3-1.7B gate|up shape on an H100 (docs/benchmarks.md)."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if not 1 <= m <= MAX_ROWS or weight.shape[1] != k:
        raise ValueError(f"triton_rows: x {tuple(x.shape)} against weight {tuple(weight.shape)} "
                         f"(1..{MAX_ROWS} rows of the weight's K)")
    x2 = x.reshape(m, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    weight = weight if weight.is_contiguous() else weight.contiguous()
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    cfg = dict(config or rows_config(weight.shape[0], k, glu=glu, **gpu_args(x.device)))
    if glu:  # BLOCK_N rows of gate and as many of up per program, whole K (one split: see the kernel)
        cfg["BLOCK_N"], cfg["SPLIT"] = max(16, cfg["BLOCK_N"] // 2), 1
    block_n, block_k = cfg["BLOCK_N"], cfg["BLOCK_K"]
    blocks = triton.cdiv(n, block_n)
    split = max(1, min(cfg.pop("SPLIT", 1), triton.cdiv(k, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split) * block_k
    split = triton.cdiv(k, k_per_split)  # none left empty
    part, count = (SPLIT_BUFFERS.get(x.device, blocks * split * block_n * DOT_ROWS, blocks) if split > 1
                   else (y, y))  # pointers the kernel does not touch with one split
    fusion = _fusion_args(x2, n, add, norm, h, residual, glu, ROWS_NORM_BLOCK, bias)
    if norm is not None:
        normed = torch.empty(m, k, dtype=x.dtype, device=x.device)
        add_, g, h_ = fusion["tensors"][:3]
        _rows_norm_kernel[(m,)](x2, add_, g, h_, normed, k, x2.stride(0), eps, ADD=add is not None,
                                BLOCK_K=fusion["flags"]["RSTD_BLOCK"], num_warps=4,  # keys per load, as named there
                                **pdl.launch_args(x.device))
        x2 = normed
    b = bias if bias is not None else weight  # a pointer the kernel does not read without HAS_BIAS
    _rows_kernel[(blocks, split)](x2, weight, b, y, part, count, m, n, k, k_per_split, x2.stride(0), y.stride(0),
                                  fusion["tensors"][3], n * k, HAS_BIAS=bias is not None, SPLIT=split,
                                  EVEN_K=k % block_k == 0, GLU=glu, RESIDUAL=residual is not None, **cfg,
                                  **pdl.launch_args(x.device))
    return y.reshape(*x.shape[:-1], n)


@functools.cache
def num_sms(index: int) -> int:
    """SMs of CUDA device ``index`` (the kernels here and decode_attention.py size their grids by it)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def gpu_name(index: int) -> str:
    """CUDA device ``index``'s name (rows_configs.py picks its built-in table by it)."""
    return torch.cuda.get_device_name(index)


def gpu_args(device: torch.device) -> dict:
    """rows_config's ``sms`` and ``device_name`` for ``device`` (a CPU tensor, under Triton's
    interpreter: the defaults)."""
    if device.type != "cuda":
        return {}
    return dict(sms=num_sms(device.index or 0), device_name=gpu_name(device.index or 0))


def max_rows() -> int:
    """The most rows a product sends to the kernels: ``$DFLASH_DECODE_GEMV_MAX_ROWS``, else MAX_ROWS."""
    text = os.environ.get(MAX_ROWS_ENV) or str(MAX_ROWS)
    if not text.isdigit() or not 1 <= int(text) <= MAX_ROWS:
        raise ConfigError(f"${MAX_ROWS_ENV}={text!r}; allowed: an integer from 1 to {MAX_ROWS}")
    return int(text)


def takes(x: Tensor, weight: Tensor, rows_limit: int = MAX_ROWS) -> bool:
    """Whether ``F.linear(x, weight)`` goes through the kernels: a CUDA input of x's dtype
    bf16/fp16, the weight's, with at most ``rows_limit`` rows (callers read :func:`max_rows`
    once, where they are built: a compiled layer then reads no environment)."""
    k = x.shape[-1]
    return (x.is_cuda and x.dtype in HALF_DTYPES and x.dtype == weight.dtype and k > 0
            and x.numel() <= rows_limit * k)


@torch.library.custom_op("dflash::matvec_linear", mutates_args=())
def matvec_linear(x: Tensor, weight: Tensor, bias: Tensor | None, rows_limit: int) -> Tensor:
    """``F.linear``, by the Triton kernels where :func:`takes` x (one row: the matrix-vector
    kernel; up to ``rows_limit``: the few-row kernel), else cuBLAS. The choice is made here, at
    run time, so that a compiled caller holds no guard on the rows (one graph serves every rows
    bucket, decode/compiled.py). The few-row kernel's split buffers are shared scratch memory:
    calls on one stream only."""
    if not takes(x, weight, min(rows_limit, MAX_ROWS)):
        return F.linear(x, weight, bias)
    if x.numel() == x.shape[-1]:
        return triton_matvec(x, weight, bias)
    return triton_rows(x, weight, bias)


@matvec_linear.register_fake
def _matvec_linear_shape(x: Tensor, weight: Tensor, bias: Tensor | None, rows_limit: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class MatVecLinear(nn.Linear):
    """An ``nn.Linear`` whose bf16/fp16 CUDA inputs of at most MAX_ROWS rows go through
    ``dflash::matvec_linear`` (a frozen target's: the op has no backward)."""

    @classmethod
    def sharing(cls, linear: nn.Linear) -> MatVecLinear:
        """A MatVecLinear over ``linear``'s own parameters (nothing copied)."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features = linear.in_features, linear.out_features
        module.weight, module.bias = linear.weight, linear.bias
        module.rows_limit = max_rows()
        return module

    def forward(self, x: Tensor) -> Tensor:
        return decode_linear(x, self.weight, self.bias, self.rows_limit)


def decode_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, rows_limit: int = MAX_ROWS) -> Tensor:
    """``F.linear(x, weight, bias)`` of an inference-only layer: a CUDA input of the weight's
    half dtype through ``dflash::matvec_linear`` (the kernels where they take its rows, decided
    inside the op), anything else by ``F.linear``."""
    if x.is_cuda and x.dtype in HALF_DTYPES and x.dtype == weight.dtype:
        return torch.ops.dflash.matvec_linear(x, weight, bias, rows_limit)
    return F.linear(x, weight, bias)


def route_matvec(*modules: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` under ``modules`` (a decoder, with its LM head) by a
    :class:`MatVecLinear` over the same parameters; how many were replaced. A table of launch
    configs that $DFLASH_DECODE_ROWS_CONFIGS names is checked here, before anything decodes."""
    rows_configs.check_setting()
    count = 0
    for root in modules:
        if type(root) is nn.Linear:
            raise ValueError("route_matvec: pass the module that holds the linear layer, not the layer")
        for parent in list(root.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, MatVecLinear.sharing(child))
                    count += 1
    return count
