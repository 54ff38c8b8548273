"""report.png, drawn with matplotlib from the numbers of collect.py.

Panels, top to bottom (each only when `numbers["panels"]` lists it):

    states    one lane per worker (targets, then drafters) colored by state over time:
              green working (target busy, drafter step), orange target waiting for work,
              red drafter waiting for hidden states, purple waiting for a slot, gray not
              recorded (message handling, checkpoints). A starved target is a lane of orange;
              a drafter-bound job is green drafters over orange targets.
    rates     the job's produced (targets) and trained (drafters) valid tokens/s
    memory    each process's GPU memory (host RSS on CPU runs) from the supervisor's polls
    training  loss (left axis) and learning rate (right axis) over optimizer steps
    eval      acceptance by block position of the latest saved evaluation (one bar per prompt
              set), tau in the title

The three time panels share one x axis (seconds since the first interval). matplotlib is an
optional extra (`pip install 'dflash-ipc[report]'`); the figure is drawn without pyplot, so
no global backend or figure state is touched.
"""

from __future__ import annotations

from dflash_ipc.errors import MissingExtraError

COLORS = {"busy": "#2ca02c", "step": "#2ca02c", "wait_work": "#ff7f0e", "wait_hidden": "#d62728",
          "wait_slot": "#9467bd"}
LEGEND = (("working", "busy"), ("waiting for work", "wait_work"), ("waiting for hidden states", "wait_hidden"),
          ("waiting for a slot", "wait_slot"))
UNRECORDED = "#d7d7d7"
PRODUCED_COLOR, TRAINED_COLOR = "#1f77b4", "#2ca02c"
EVAL_COLORS = ("#2ca02c", "#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#17becf")
WIDTH_IN = 12.0
PANEL_IN = 2.6      # height of each panel but the lanes
LANE_IN = 0.32      # height of one worker lane
DPI = 100


def _matplotlib():
    """(Figure, FigureCanvasAgg, Patch); MissingExtraError naming the extra when absent."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise MissingExtraError("dflash-ipc report draws with matplotlib, which is not installed: "
                                "pip install 'dflash-ipc[report]'") from None
    return Figure, FigureCanvasAgg, Patch


def _states(ax, numbers: dict, patch) -> None:
    lanes = numbers["states"]
    span = numbers["span_s"]
    for i, (role, rows) in enumerate(lanes.items()):
        y = len(lanes) - 1 - i  # first worker on top
        ax.broken_barh([(0.0, span)], (y - 0.4, 0.8), color=UNRECORDED)
        for state, color in COLORS.items():
            bars = [(t0, t1 - t0) for t0, t1, s in rows if s == state]
            if bars:
                ax.broken_barh(bars, (y - 0.4, 0.8), color=color)
    workers = numbers["workers"]
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"{role}  {100 * (workers[role]['busy_fraction'] or 0):.0f}%" for role in reversed(lanes)])
    handles = [patch(color=COLORS[state], label=name) for name, state in LEGEND]
    handles.append(patch(color=UNRECORDED, label="not recorded"))
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=5, fontsize=8, frameon=False,
              borderaxespad=0.1)
    ax.set_title("worker states (busy share)", loc="left", fontsize=10)


def _rates(ax, numbers: dict) -> None:
    rates = numbers["rates"]
    ax.plot(rates["t"], rates["produced_tokens_per_s"], color=PRODUCED_COLOR, label="produced (targets)")
    ax.plot(rates["t"], rates["trained_tokens_per_s"], color=TRAINED_COLOR, label="trained (drafters)")
    ax.set_ylabel("tokens/s")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("valid tokens per second", loc="left", fontsize=10)


def _memory(ax, numbers: dict) -> None:
    memory = numbers["memory"]
    for role, lane in memory["workers"].items():
        ax.plot(lane["t"], lane["mib"], label=role, drawstyle="steps-post")
    gpu = memory["metric"].startswith("gpu")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, ncol=4, loc="lower right")
    ax.set_title("GPU memory reserved per process" if gpu else
                 "host RSS per process (no process reported GPU memory)", loc="left", fontsize=10)


def _training(ax, numbers: dict) -> None:
    training = numbers["training"]
    ax.plot(training["step"], [v if v is not None else float("nan") for v in training["loss"]],
            color="#1f77b4", label="loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss", color="#1f77b4")
    lr = ax.twinx()
    lr.plot(training["step"], [v if v is not None else float("nan") for v in training["lr"]],
            color="#7f7f7f", linestyle="--", label="learning rate")
    lr.set_ylabel("learning rate", color="#7f7f7f")
    lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    ax.set_title("drafter loss and learning rate", loc="left", fontsize=10)


def _eval(ax, numbers: dict) -> None:
    """Acceptance by block position, one bar per prompt set of the latest evaluation at each."""
    results = numbers["eval"]
    width = 0.8 / len(results)
    longest = max(len(r["acceptance_per_position"]) for r in results)
    for i, result in enumerate(results):
        rates = result["acceptance_per_position"]
        offset = (i - (len(results) - 1) / 2) * width
        ax.bar([k + offset for k in range(1, len(rates) + 1)], [v if v is not None else 0.0 for v in rates],
               width=width, color=EVAL_COLORS[i % len(EVAL_COLORS)], label=result.get("prompt_set") or "-")
    ax.set_xticks(range(1, longest + 1))
    ax.set_xlabel("block position")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1)
    if len(results) > 1:
        ax.legend(fontsize=8, loc="upper right")
    parts = []
    for result in results:
        tau, rate = result.get("tau"), result.get("tokens_per_s")
        parts.append(f"{result.get('prompt_set') or '-'} tau {'-' if tau is None else f'{tau:.2f}'}"
                     + (f", {rate:,.0f} tok/s" if rate is not None else ""))
    ax.set_title(f"latest eval: {'; '.join(parts)}  ({results[0].get('label', '')})", loc="left", fontsize=10)


def render(numbers: dict, path: str) -> None:
    """Writes the PNG of `numbers` (collect.collect's dict) to `path`."""
    figure_class, canvas_class, patch = _matplotlib()
    panels = numbers["panels"]
    heights = [max(1.2, LANE_IN * len(numbers["states"])) if p == "states" else PANEL_IN for p in panels]
    height_in = sum(heights) + 0.9 * len(panels) + 0.6  # panels, their titles and axis labels, the title
    fig = figure_class(figsize=(WIDTH_IN, height_in), dpi=DPI)
    canvas_class(fig)
    grid = fig.add_gridspec(len(panels), 1, height_ratios=heights, hspace=0.9 * len(panels) / sum(heights),
                            top=1 - 0.7 / height_in, bottom=0.5 / height_in)
    time_axis = None
    for row, panel in enumerate(panels):
        shared = panel in ("states", "rates", "memory")
        ax = fig.add_subplot(grid[row], sharex=time_axis if shared else None)
        if shared:
            time_axis = time_axis or ax
            ax.set_xlabel("seconds since the first worker interval")
        if panel == "states":
            _states(ax, numbers, patch)
        else:
            {"rates": _rates, "memory": _memory, "training": _training, "eval": _eval}[panel](ax, numbers)
    fig.suptitle(f"{numbers['run_dir']}  ({numbers['span_s']:.0f} s)", fontsize=11, y=1 - 0.2 / height_in)
    fig.savefig(path, format="png", bbox_inches="tight")
