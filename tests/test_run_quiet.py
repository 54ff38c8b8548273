"""run/quiet.py drops torchao's import lines (and only them); `make run` builds an environment
without the test extras (torchao among them), `make test` one with them."""

import logging
import os
import subprocess

import pytest

from dflash_ipc.run.quiet import quiet_unactionable_warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The lines as a plain CPU job printed them (torch 2.13 CPU, torchao 0.18, transformers 5).
NOISE = [
    ("torchao", "Failed to load %s: Could not load this library: %s",
     ("/venv/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so",) * 2),
    ("torchao.kernel.intmm", "Warning: Detected no triton, on systems without Triton certain kernels will not work", ()),
    ("torch.utils._pytree", "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value "
     "type. Calling register_constant() on Enum subclasses is deprecated and will be an error in a future release.",
     ("<enum 'KernelPreference'>",)),
]
KEPT = [
    ("torchao", "Failed to load %s: %s", ("x.so", "undefined symbol: foo")),
    ("torchao", "Skipping import of cpp extensions due to incompatible torch version.", ()),
    ("torch.utils._pytree", "something else about pytrees", ()),
]


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def collected():
    quiet_unactionable_warnings()
    quiet_unactionable_warnings()  # idempotent
    handler = _Collect()
    loggers = {logging.getLogger(name) for name, _, _ in NOISE + KEPT}
    for logger in loggers:
        logger.addHandler(handler)
    yield handler
    for logger in loggers:
        logger.removeHandler(handler)


def test_torchao_import_lines_are_dropped_and_the_rest_of_those_loggers_passes(collected):
    for name, message, args in NOISE + KEPT:
        logging.getLogger(name).warning(message, *args)
    assert collected.lines == [message % args for _, message, args in KEPT]
    assert all(len([f for f in logging.getLogger(n).filters if type(f).__name__ == "_DropUnactionable"]) == 1
               for n in ("torchao", "torchao.kernel.intmm", "torch.utils._pytree"))


def _make_dry_run(target: str, tmp_path) -> str:
    out = subprocess.run(["make", "-n", "-C", REPO, target, f"VENV={tmp_path}/run", f"TEST_VENV={tmp_path}/test"],
                         capture_output=True, text=True, timeout=30, check=True)
    return out.stdout


def test_make_run_installs_no_test_extras_and_make_test_installs_them(tmp_path):
    run = _make_dry_run("run", tmp_path)
    assert "pip install -q -e '.[tensorboard,report]'" in run and "[test]" not in run and "torchao" not in run
    assert "bin/dflash-up" in run and f"{tmp_path}/test" not in run
    test = _make_dry_run("test", tmp_path)
    assert "pip install -q -e '.[test]'" in test and f"TEST_PYTHON={tmp_path}/test/bin/python" in test
    assert f"{tmp_path}/run/" not in test
