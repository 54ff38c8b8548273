"""`dflash-ipc report RUN_DIR`: one PNG that shows, at a glance, who worked and who waited.

Top panel: one lane per worker (targets, then drafters), colored by state over wall-clock
time: green = working (target `busy`, drafter `step`), orange = target waiting for work,
red = drafter waiting for hidden states, purple = waiting for a slot, gray = not recorded
(message handling, checkpoints, before the first and after the last interval). Bottom panel:
the job's rates over time, targets' produced tokens/s (blue) and drafters' trained tokens/s
(green), from the same intervals. A starved target is a lane full of orange; a drafter-bound
job is green drafters over orange targets.

No plotting library: the picture is drawn into a numpy RGB array (a 5x7 bitmap font for the
few labels) and encoded as PNG here (zlib + the three chunks a PNG needs).
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import zlib

import numpy as np

from dflash_ipc.errors import DataError
from dflash_ipc.metrics import load_timelines, metrics_dir, rate_series, summarize

log = logging.getLogger(__name__)

WIDTH = 1200
MARGIN = 8
LABEL_W = 200      # left column: role name and busy fraction
LANE_H = 22
LANE_GAP = 6
RATE_H = 180
SCALE = 2          # font pixels per bitmap pixel
BACKGROUND = (255, 255, 255)
UNRECORDED = (215, 215, 215)
INK = (30, 30, 30)
COLORS = {"busy": (44, 160, 44), "step": (44, 160, 44), "wait_work": (255, 127, 14),
          "wait_hidden": (214, 39, 40), "wait_slot": (148, 103, 189)}
DRAW_ORDER = ("wait_work", "wait_hidden", "wait_slot", "busy", "step")  # work drawn last, on top
TGT_COLOR = (31, 119, 180)
RATE_BINS = 100       # time bins of the rate panel
RATE_WINDOW_BINS = 7  # rates are moving averages over this many bins
TOK_COLOR = (44, 160, 44)

# 5x7 glyphs, one 5-bit row per entry, most significant bit on the left.
FONT = {
    "A": (14, 17, 17, 31, 17, 17, 17), "B": (30, 17, 17, 30, 17, 17, 30), "C": (14, 17, 16, 16, 16, 17, 14),
    "D": (28, 18, 17, 17, 17, 18, 28), "E": (31, 16, 16, 30, 16, 16, 31), "F": (31, 16, 16, 30, 16, 16, 16),
    "G": (14, 17, 16, 23, 17, 17, 15), "H": (17, 17, 17, 31, 17, 17, 17), "I": (14, 4, 4, 4, 4, 4, 14),
    "J": (7, 2, 2, 2, 2, 18, 12), "K": (17, 18, 20, 24, 20, 18, 17), "L": (16, 16, 16, 16, 16, 16, 31),
    "M": (17, 27, 21, 21, 17, 17, 17), "N": (17, 17, 25, 21, 19, 17, 17), "O": (14, 17, 17, 17, 17, 17, 14),
    "P": (30, 17, 17, 30, 16, 16, 16), "Q": (14, 17, 17, 17, 21, 18, 13), "R": (30, 17, 17, 30, 20, 18, 17),
    "S": (15, 16, 16, 14, 1, 1, 30), "T": (31, 4, 4, 4, 4, 4, 4), "U": (17, 17, 17, 17, 17, 17, 14),
    "V": (17, 17, 17, 17, 17, 10, 4), "W": (17, 17, 17, 21, 21, 21, 10), "X": (17, 17, 10, 4, 10, 17, 17),
    "Y": (17, 17, 17, 10, 4, 4, 4), "Z": (31, 1, 2, 4, 8, 16, 31),
    "0": (14, 17, 19, 21, 25, 17, 14), "1": (4, 12, 4, 4, 4, 4, 14), "2": (14, 17, 1, 2, 4, 8, 31),
    "3": (31, 2, 4, 2, 1, 17, 14), "4": (2, 6, 10, 18, 31, 2, 2), "5": (31, 16, 30, 1, 1, 17, 14),
    "6": (6, 8, 16, 30, 17, 17, 14), "7": (31, 1, 2, 4, 8, 8, 8), "8": (14, 17, 17, 14, 17, 17, 14),
    "9": (14, 17, 17, 15, 1, 2, 12),
    "/": (0, 1, 2, 4, 8, 16, 0), "-": (0, 0, 0, 31, 0, 0, 0), "_": (0, 0, 0, 0, 0, 0, 31),
    ".": (0, 0, 0, 0, 0, 12, 12), ":": (0, 12, 12, 0, 12, 12, 0), "%": (24, 25, 2, 4, 8, 19, 3),
    "=": (0, 0, 31, 0, 31, 0, 0), " ": (0,) * 7,
}


def encode_png(image: np.ndarray) -> bytes:
    """PNG bytes of an RGB uint8 image [H, W, 3]: 8-bit truecolor, filter 0 on every row."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"encode_png wants uint8 [H, W, 3], got {image.dtype} {image.shape}")
    height, width, _ = image.shape
    rows = np.concatenate([np.zeros((height, 1), np.uint8), image.reshape(height, width * 3)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # depth 8, truecolor
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(rows.tobytes(), 6)) + chunk(b"IEND", b""))


def draw_text(image: np.ndarray, x: int, y: int, text: str, color=INK, scale: int = SCALE) -> int:
    """Draws `text` (upper-cased; unknown characters as blanks) with its top left at (x, y);
    returns the x after the last character. Clipped at the image border."""
    height, width, _ = image.shape
    for char in text.upper():
        for row, bits in enumerate(FONT.get(char, FONT[" "])):
            for col in range(5):
                if bits >> (4 - col) & 1:
                    y0, x0 = y + row * scale, x + col * scale
                    image[max(0, y0):min(height, y0 + scale), max(0, x0):min(width, x0 + scale)] = color
        x += 6 * scale
    return x


def _line(image: np.ndarray, xs: np.ndarray, ys: np.ndarray, color) -> None:
    """A 2 px polyline through points with increasing x: every column between them gets the
    interpolated y, joined to the previous column's by a vertical run."""
    columns = np.arange(xs[0], xs[-1] + 1)
    heights = np.round(np.interp(columns, xs, ys)).astype(int)
    previous = heights[0]
    for x, y in zip(columns, heights):
        lo, hi = sorted((previous, y))
        image[lo:hi + 2, x:x + 2] = color
        previous = y


def render(timelines: dict[str, list[dict]], summaries: dict[str, dict]) -> np.ndarray:
    """The report picture, RGB uint8 [H, W, 3]."""
    starts = [r["t0"] for rows in timelines.values() for r in rows]
    ends = [r["t1"] for rows in timelines.values() for r in rows]
    start, end = min(starts), max(ends)
    span = max(end - start, 1e-6)
    plot_x, plot_w = MARGIN + LABEL_W, WIDTH - 2 * MARGIN - LABEL_W
    legend_h = 7 * SCALE + 2 * MARGIN
    lanes_top = legend_h + MARGIN
    rate_top = lanes_top + len(timelines) * (LANE_H + LANE_GAP) + 2 * MARGIN + 7 * SCALE
    height = rate_top + RATE_H + 2 * MARGIN + 7 * SCALE
    image = np.full((height, WIDTH, 3), BACKGROUND, np.uint8)

    x = MARGIN
    for name, color in (("working", COLORS["busy"]), ("wait work", COLORS["wait_work"]),
                        ("wait hidden", COLORS["wait_hidden"]), ("wait slot", COLORS["wait_slot"]),
                        ("not recorded", UNRECORDED)):
        image[MARGIN:MARGIN + 7 * SCALE, x:x + 7 * SCALE] = color
        x = draw_text(image, x + 9 * SCALE, MARGIN, name) + 10 * SCALE

    def to_x(t: float) -> int:
        return plot_x + int(round((t - start) / span * plot_w))

    for lane, (role, rows) in enumerate(timelines.items()):
        top = lanes_top + lane * (LANE_H + LANE_GAP)
        fraction = summaries[role]["busy_fraction"]
        draw_text(image, MARGIN, top + (LANE_H - 7 * SCALE) // 2, f"{role} {100 * fraction:3.0f}%")
        image[top:top + LANE_H, plot_x:plot_x + plot_w] = UNRECORDED
        for state in DRAW_ORDER:
            for row in rows:
                if row["state"] == state:
                    x0 = to_x(row["t0"])
                    image[top:top + LANE_H, x0:max(x0 + 1, to_x(row["t1"]))] = COLORS[state]

    axis_y = lanes_top + len(timelines) * (LANE_H + LANE_GAP)
    draw_text(image, plot_x, axis_y, "0 s")
    label = f"{span:.1f} s"
    draw_text(image, plot_x + plot_w - 6 * SCALE * len(label), axis_y, label)
    _draw_rates(image, timelines, start, end, plot_x, plot_w, rate_top)
    return image


def _draw_rates(image: np.ndarray, timelines: dict[str, list[dict]], start: float, end: float,
                plot_x: int, plot_w: int, top: int) -> None:
    """Lower panel: job-wide produced (targets) and trained (drafters) tokens/s over time."""
    num_bins = RATE_BINS
    bin_s = max((end - start) / num_bins, 1e-6)
    rates = {}
    for kind in ("target", "drafter"):
        series = [rate_series(rows, "tokens", start, end, bin_s, RATE_WINDOW_BINS)[:num_bins]
                  for role, rows in timelines.items()
                  if role.startswith(kind + "/")]
        rates[kind] = np.sum([np.pad(s, (0, num_bins - len(s))) for s in series], axis=0) if series \
            else np.zeros(num_bins)
    peak = max(float(rates["target"].max()), float(rates["drafter"].max()), 1e-9)
    image[top:top + RATE_H, plot_x] = INK
    image[top + RATE_H, plot_x:plot_x + plot_w] = INK
    xs = plot_x + 2 + ((np.arange(num_bins) + 0.5) / num_bins * (plot_w - 4)).astype(int)
    for kind, color in (("target", TGT_COLOR), ("drafter", TOK_COLOR)):
        ys = top + RATE_H - 2 - (rates[kind] / peak * (RATE_H - 4)).astype(int)
        _line(image, xs, ys, color)
    draw_text(image, MARGIN, top, "tokens/s")
    draw_text(image, MARGIN, top + 10 * SCALE, f"max {peak:.0f}")
    draw_text(image, MARGIN, top + 30 * SCALE, "tgt produced", TGT_COLOR)
    draw_text(image, MARGIN, top + 40 * SCALE, "tok trained", TOK_COLOR)


def _drafter_losses(run_dir: str) -> list[float]:
    """Rank 0's per-step losses from `drafter_metrics.jsonl` (finite ones), if the file is there."""
    path = os.path.join(run_dir, "drafter_metrics.jsonl")
    if not os.path.exists(path):
        return []
    losses = []
    with open(path) as f:
        for line in f:
            try:
                loss = json.loads(line).get("loss")
            except json.JSONDecodeError:
                continue
            if isinstance(loss, (int, float)) and math.isfinite(loss):
                losses.append(float(loss))
    return losses


def build_report(run_dir: str, out_path: str | None = None) -> dict:
    """Reads `<run_dir>/metrics/*.jsonl`, writes the PNG (default `<run_dir>/report.png`) and
    returns `{"png": path, "workers": {role: summary}, "loss_first": .., "loss_last": ..}`."""
    timelines = {role: rows for role, rows in load_timelines(run_dir).items() if rows}
    if not timelines:
        raise DataError(f"{metrics_dir(run_dir)}: no worker timelines (*.jsonl with intervals) to report; "
                        f"was the job run with this version, in this run directory?")
    summaries = {role: summarize(rows) for role, rows in timelines.items()}
    out_path = out_path or os.path.join(run_dir, "report.png")
    with open(out_path, "wb") as f:
        f.write(encode_png(render(timelines, summaries)))
    losses = _drafter_losses(run_dir)
    return {"png": out_path, "workers": summaries,
            "loss_first": losses[0] if losses else float("nan"),
            "loss_last": losses[-1] if losses else float("nan")}


def format_summary(report: dict) -> str:
    """The per-worker table `dflash-ipc report` prints."""
    lines = [f"{'worker':<11} {'busy':>6} {'wait_s':>8} {'work_s':>8} {'n':>6} {'tok/s':>9} "
             f"{'anch/s':>8} {'seq/s':>7} {'step_ms':>8} {'loss':>7}"]
    for role, s in report["workers"].items():
        wait = s["wait_work_s"] + s["wait_hidden_s"] + s["wait_slot_s"]
        step_ms = f"{1000 * s['step_s_mean']:.1f}" if "step_s_mean" in s else "-"
        loss = f"{s['loss_last']:.3f}" if "loss_last" in s else "-"
        lines.append(f"{role:<11} {100 * s['busy_fraction']:5.1f}% {wait:8.1f} {s['busy_s'] + s['step_s']:8.1f} "
                     f"{s['count']:6d} {s['tokens_per_s']:9.0f} {s['anchors_per_s']:8.1f} "
                     f"{s['sequences_per_s']:7.2f} {step_ms:>8} {loss:>7}")
    return "\n".join(lines)
