"""report.png, drawn with matplotlib from the numbers of collect.py.

One 16:9 picture (1600 x 900 pixels: a slide), titled with the job's name (its run directory's
name), its duration and its workers. The panels, each only when `numbers["panels"]` lists it:

  left column, over time (one shared axis: seconds since the first interval, labelled once
  at the bottom, the same span in every panel whatever each source covers):
    states    one lane per worker (targets, then drafters) colored by state over time:
              green working (target busy, drafter step), orange target waiting for work,
              red drafter waiting for hidden states, purple waiting for a slot, gray not
              recorded (message handling, checkpoints). A starved target is a lane of orange;
              a drafter-bound job is green drafters over orange targets.
    rates     the job's produced (targets) and trained (drafters) valid tokens/s
    memory    each process's GPU memory (host RSS on CPU runs) from the supervisor's polls
  right column:
    training  loss (left axis) and learning rate (right axis) over optimizer steps
    eval      acceptance by block position of the latest saved evaluation (one bar per prompt
              set), tau in the title; when no drafted token was accepted, a note that says so
              instead of an empty frame

Legends sit above their panel, outside the data (the memory panel's, with many processes,
where matplotlib finds the emptiest corner). matplotlib is an optional extra (`pip install
'dflash-ipc[report]'`); the figure is drawn without pyplot, so no global backend or figure
state is touched.
"""

from __future__ import annotations

import os

from dflash_ipc.errors import MissingExtraError
from dflash_ipc.obs.progress import format_duration

COLORS = {"busy": "#2ca02c", "step": "#2ca02c", "wait_work": "#ff7f0e", "wait_hidden": "#d62728",
          "wait_slot": "#9467bd"}
LEGEND = (("working", "busy"), ("waiting for work", "wait_work"), ("waiting for hidden states", "wait_hidden"),
          ("waiting for a slot", "wait_slot"))
UNRECORDED = "#d7d7d7"
PRODUCED_COLOR, TRAINED_COLOR = "#1f77b4", "#2ca02c"
EVAL_COLORS = ("#2ca02c", "#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#17becf")
WIDTH_IN, HEIGHT_IN = 16.0, 9.0  # 16:9, a slide
DPI = 100
TIME_PANELS = ("states", "rates", "memory")
SIDE_PANELS = ("training", "eval")
MAX_MEMORY_LINES = 4  # more processes than this: the memory panel draws (and names) one color per kind
KIND_COLORS = {"target": PRODUCED_COLOR, "drafter": TRAINED_COLOR}


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
    _legend_above(ax, handles=handles, ncol=3)  # five entries in two rows: clear of the title
    ax.set_title("worker states (busy share)", loc="left", fontsize=10)


def _rates(ax, numbers: dict) -> None:
    rates = numbers["rates"]
    ax.plot(rates["t"], rates["produced_tokens_per_s"], color=PRODUCED_COLOR, label="produced (targets)")
    ax.plot(rates["t"], rates["trained_tokens_per_s"], color=TRAINED_COLOR, label="trained (drafters)")
    ax.set_ylabel("tokens/s")
    ax.set_ylim(bottom=0)
    _legend_above(ax, ncol=2)
    ax.set_title("valid tokens per second", loc="left", fontsize=10)


def _memory(ax, numbers: dict) -> None:
    memory = numbers["memory"]
    lanes = memory["workers"]
    # A few processes: one line and legend entry each. More: one color and one entry per kind
    # (all targets, all drafters), since a legend of 12+ lines no longer fits beside the title
    # and the colors would repeat; report.json keeps every process apart.
    by_kind = len(lanes) > MAX_MEMORY_LINES
    labelled: set[str] = set()
    for role, lane in lanes.items():
        kind = role.partition("/")[0]
        if by_kind:
            count = sum(r.partition("/")[0] == kind for r in lanes)
            label = None if kind in labelled else f"{kind}s ({count} processes)"
            labelled.add(kind)
            ax.plot(lane["t"], lane["mib"], label=label, drawstyle="steps-post", alpha=0.7,
                    color=KIND_COLORS.get(kind, UNRECORDED))
        else:
            ax.plot(lane["t"], lane["mib"], label=role, drawstyle="steps-post")
    gpu = memory["metric"].startswith("gpu")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    _legend_above(ax, ncol=MAX_MEMORY_LINES)
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
    parts = []
    for result in results:
        tau, rate = result.get("tau"), result.get("tokens_per_s")
        parts.append(f"{result.get('prompt_set') or '-'} tau {'-' if tau is None else f'{tau:.2f}'}"
                     + (f", {rate:,.0f} tok/s" if rate is not None else ""))
    # One set: its figures in the title. Several: each set's in its legend entry (a title of
    # them all would run into the legend). The figures first, the drafter below them.
    title = f"latest eval: {parts[0]}" if len(results) == 1 else "latest eval"
    ax.set_title(f"{title}\n{short_label(results[0].get('label', ''))}", loc="left", fontsize=10)
    note = no_accepted_note(results)
    if note is not None:
        ax.text(0.5, 0.5, note, transform=ax.transAxes, ha="center", va="center", fontsize=11, wrap=True)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    width = 0.8 / len(results)
    longest = max(len(r["acceptance_per_position"]) for r in results)
    for i, result in enumerate(results):
        rates = result["acceptance_per_position"]
        offset = (i - (len(results) - 1) / 2) * width
        ax.bar([k + offset for k in range(1, len(rates) + 1)], [v if v is not None else 0.0 for v in rates],
               width=width, color=EVAL_COLORS[i % len(EVAL_COLORS)], label=parts[i])
    ax.set_xticks(range(1, longest + 1))
    ax.set_xlabel("block position")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1)
    if len(results) > 1:
        ax.legend(fontsize=8, loc="best")  # acceptance falls with position: a corner is free


def short_label(label: str, keep: int = 2) -> str:
    """An eval's label with each path in it cut to its last `keep` components: the panel is a
    third of the slide wide, and a drafter's absolute path ran its title off the picture."""
    words = []
    for word in label.split(" "):
        parts = word.split(os.sep)
        words.append(os.sep.join(["..."] + parts[-keep:]) if word.startswith(os.sep) and len(parts) > keep + 1
                     else word)
    return " ".join(words)


def no_accepted_note(results: list[dict]) -> str | None:
    """The eval panel's text when no prompt set accepted a single drafted token (bars of
    height 0 would draw an empty frame that reads as a missing panel); None otherwise."""
    if any(v for r in results for v in r["acceptance_per_position"] if v is not None):
        return None
    return "no accepted tokens:\nevery drafted token of every prompt set was rejected"


def _legend_above(ax, **kwargs) -> None:
    """A legend above the panel, right-aligned opposite the left-aligned title: never on the data."""
    kwargs.setdefault("fontsize", 8)
    ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), frameon=False, borderaxespad=0.1, **kwargs)


def job_title(numbers: dict) -> str:
    """The picture's title: the run directory's name (the job's), its duration, its workers."""
    roles = list(numbers["workers"])
    counts = [(sum(r.startswith(k + "/") for r in roles), k) for k in ("target", "drafter")]
    kinds = [f"{n} {k}{'' if n == 1 else 's'}" for n, k in counts]
    name = os.path.basename(os.path.normpath(numbers["run_dir"])) or numbers["run_dir"]
    return f"{name}: {format_duration(numbers['span_s'])}, {', '.join(kinds)}"


def figure(numbers: dict):
    """The matplotlib Figure of `numbers` (collect.collect's dict), laid out for a slide."""
    figure_class, canvas_class, patch = _matplotlib()
    panels = numbers["panels"]
    time_panels = [p for p in panels if p in TIME_PANELS]
    side_panels = [p for p in panels if p in SIDE_PANELS]
    fig = figure_class(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI, layout="constrained")
    canvas_class(fig)
    columns = [c for c in (time_panels, side_panels) if c]
    outer = fig.add_gridspec(1, len(columns), width_ratios=[3, 2][:len(columns)] if len(columns) == 2 else [1])
    time_axis = None
    for column, names in enumerate(columns):
        heights = [max(1.0, 0.25 * len(numbers["states"])) if p == "states" else 1.0 for p in names]
        cells = outer[column].subgridspec(len(names), 1, height_ratios=heights)
        for row, panel in enumerate(names):
            shared = panel in TIME_PANELS
            ax = fig.add_subplot(cells[row], sharex=time_axis if shared else None)
            if panel == "states":
                _states(ax, numbers, patch)
            else:
                {"rates": _rates, "memory": _memory, "training": _training, "eval": _eval}[panel](ax, numbers)
            if shared:
                time_axis = time_axis or ax
                ax.set_xlim(0, max(numbers["span_s"], 1e-6))
                if row == len(names) - 1:
                    ax.set_xlabel("seconds since the first worker interval")
                else:
                    ax.tick_params(labelbottom=False)
    fig.suptitle(job_title(numbers), fontsize=13)
    return fig


def render(numbers: dict, path: str) -> None:
    """Writes the PNG of `numbers` (collect.collect's dict) to `path`: WIDTH_IN x HEIGHT_IN at
    DPI, uncropped (a tight crop would change the aspect)."""
    figure(numbers).savefig(path, format="png")
