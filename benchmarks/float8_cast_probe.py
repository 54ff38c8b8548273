"""Which tiles of the float8 cast kernel write a right transpose, per source dtype and shape.

    python3 -m benchmarks.float8_cast_probe

drafter/float8_cast.py's kernel writes ``x`` in float8 row-major and transposed. Its transposed
output from float32 has been wrong on an H100 (Triton of torch 2.11) at some tiles and right at
others, so the autotuner's pick decided it. This launches every tile of ``float8_cast._TILES``
(no autotuning) for each source dtype, both ways of writing the transposed tile (``tl.trans`` of
the float8 tile, and the tile loaded again through transposed addresses), at the
drafter's weight shapes and some odd ones, three times each, and prints per tile and way whether
the transposed output equals torch's transpose of the row-major one (and whether the row-major one
equals the torch reference), then the tiles that were right everywhere.
"""

from __future__ import annotations

import torch

from dflash_ipc.drafter import float8_cast

SHAPES = ((48, 4096), (1000, 208), (4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288), (4096, 20480))


def probe(x: torch.Tensor, config, reload: bool, dtype: torch.dtype) -> tuple[bool, bool]:
    """(transposed right, row-major right) over three launches of one tile."""
    n, k = x.shape
    scale, fmax = torch.tensor(37.5, device=x.device), torch.finfo(dtype).max
    want, _ = float8_cast.cast_reference(x, scale, torch.zeros(1, device=x.device), dtype, transpose=False)
    t_ok = r_ok = True
    for _ in range(3):
        q = torch.empty(n, k, dtype=dtype, device=x.device)
        qt = torch.empty(k, n, dtype=dtype, device=x.device)
        cdiv = float8_cast.triton.cdiv
        grid = (cdiv(n, config.kwargs["BLOCK_N"]), cdiv(k, config.kwargs["BLOCK_K"]))
        float8_cast._float8_cast_kernel[grid](x, q, qt, scale, torch.zeros(1, device=x.device), n, k,
                                              x.stride(0), x.stride(1), FMAX=fmax, TRANSPOSE=True,
                                              RELOAD_TRANSPOSE=reload, num_warps=config.num_warps, **config.kwargs)
        if x.is_cuda:
            torch.cuda.synchronize()
        t_ok &= torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))
        r_ok &= torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    return t_ok, r_ok


def main(device: str = "cuda") -> None:
    torch.manual_seed(0)
    where = torch.cuda.get_device_name() if device == "cuda" else device
    print(f"float8 cast kernel tiles on {where}, torch {torch.__version__}, "
          f"triton {float8_cast.triton.__version__}")
    always = {}
    for src in (torch.float32, torch.bfloat16):
        for reload in (True, False):
            for config in float8_cast._TILES:
                tile = (config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"], config.num_warps)
                cells = []
                for shape in SHAPES:
                    x = (torch.randn(*shape, device=device) * 5).to(src)
                    try:
                        t_ok, r_ok = probe(x, config, reload, torch.float8_e4m3fn)
                        cells.append(("T" if t_ok else "t") + ("R" if r_ok else "r"))
                    except Exception as error:  # a tile past the GPU's shared memory
                        cells.append(f"error {type(error).__name__}")
                right = all(c == "TR" for c in cells)
                always[(src, reload, tile)] = right
                print(f"  {str(src):15s} {'reloaded' if reload else 'tl.trans':9s} {str(tile):16s} "
                      + " ".join(f"{s[0]}x{s[1]}:{c}" for s, c in zip(SHAPES, cells)))
    print("right at every shape (T: transpose right, R: row-major right):")
    for (src, reload, tile), right in always.items():
        print(f"  {str(src):15s} {'reloaded' if reload else 'tl.trans':9s} {str(tile):16s} {right}")


if __name__ == "__main__":
    main()
