"""The supervisor's one-line status, from the dispatcher's `StatusReply`."""

from __future__ import annotations


def _mean_metric(workers: dict, name: str) -> float | None:
    values = [w["metrics"][name] for w in workers.values() if name in w.get("metrics", {})]
    return sum(values) / len(values) if values else None


def format_status(status: dict, *, final: bool = False) -> str:
    """e.g. `[   42s]  61% 18/30 batches | tgt_rate 5,210 dft_rate 5,050 tok_rate 4,980 tok/s |
    step 12 loss 4.812 | pending 8 leased 5 produced 2 consumed 3 | free slots 14`."""
    b = status["batches"]
    # The last line of a job shows whole-run averages; live lines a trailing window.
    rates = status["average_rates"] if final and "average_rates" in status else status["rates"]
    done = b.get("committed", 0)
    total = max(1, status["num_batches"])
    loss = _mean_metric(status["drafters"], "loss")
    step = _mean_metric(status["drafters"], "step")
    free = sum(t["free_slots"] for t in status["targets"].values())
    parts = [
        f"[{status['elapsed_s']:5.0f}s] {100 * done / total:3.0f}% {done}/{status['num_batches']} batches",
        f"tgt_rate {rates['tgt_rate']:,.0f} dft_rate {rates['dft_rate']:,.0f} tok_rate {rates['tok_rate']:,.0f} tok/s",
        (f"step {step:.0f} loss {loss:.3f}" if loss is not None else "step - loss -"),
        f"pending {b.get('pending', 0)} leased {b.get('leased', 0)} produced {b.get('produced', 0)} "
        f"consumed {b.get('consumed', 0)}",
        f"free slots {free}",
    ]
    line = " | ".join(parts)
    return ("done, averages: " + line) if final else line
