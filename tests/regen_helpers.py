"""Shared by the regenerate tests: write an input file, run a backend over it."""

import json

from dflash_ipc.regenerate.hf import HFBackend
from dflash_ipc.regenerate.options import GenerationOptions
from dflash_ipc.regenerate.run import regenerate


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run_backend(backend, inp, out, options):
    """regenerate inp -> out with backend (closed afterwards); returns the report."""
    try:
        return regenerate(str(inp), str(out), backend, options, progress=False)
    finally:
        backend.close()


def run_hf(target, inp, out, options=None, **backend_kw):
    """regenerate with an HFBackend built from backend_kw (devices default cpu)."""
    options = options or GenerationOptions(max_new_tokens=12)
    backend = HFBackend(target, options, **({"devices": "cpu"} | backend_kw))
    return run_backend(backend, inp, out, options)
