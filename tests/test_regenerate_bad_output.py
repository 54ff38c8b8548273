"""regenerate's --out gone wrong: a device, one of the inputs, a second run on it, a full disk,
SIGTERM, a dtype recorded as "auto". Each is one clear error line (or a clean partial stop), nothing written is
lost, and a rerun resumes. In-process with a fake backend (no model), except one subprocess
for SIGTERM across device processes."""

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from dflash_ipc.errors import DataError
from dflash_ipc.regenerate import output as output_mod
from dflash_ipc.regenerate import run as run_mod
from dflash_ipc.regenerate.conversation import Reply
from dflash_ipc.regenerate.options import GenerationOptions
from dflash_ipc.regenerate.output import OutputFailed, RegenOutput
from dflash_ipc.regenerate.run import regenerate
from dflash_ipc.regenerate.stop import StopOnSigterm

from regen_helpers import write_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONS = GenerationOptions(max_new_tokens=4)


class FakeBackend:
    """Answers two requests per poll; `on_poll(backend)` runs before each answer (a signal, a count)."""

    name = "fake"

    def __init__(self, on_poll=None):
        self.queue, self.polls, self.on_poll = [], 0, on_poll

    def describe(self):
        return {"backend": "fake"}

    def prepare(self, request):
        pass

    def submit(self, request):
        self.queue.append(request)

    def poll(self, *, flush, timeout_s=0.5):
        self.polls += 1
        if self.on_poll is not None:
            self.on_poll(self)
        done, self.queue = self.queue[:2], self.queue[2:]
        return [Reply(r.key, text=f"reply to row {r.key[0]}", num_tokens=1) for r in done]

    def close(self):
        pass


def chats(tmp_path, n=10, name="in.jsonl"):
    return write_rows(tmp_path / name, [{"messages": [{"role": "user", "content": f"question {i}"}]}
                                        for i in range(n)])


def run_fake(inp, out, backend=None, **kw):
    return regenerate(str(inp), str(out), backend or FakeBackend(), OPTIONS, progress=False, **kw)


def cli(monkeypatch, capsys, *args):
    """`dflash-ipc regenerate ARGS` in this process, the openai backend's construction replaced by a
    fake backend that records it was made (the model load an --out check must come before)."""
    from dflash_ipc.cli import run
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level  # setup_logging replaces them: put them back
    made = []
    monkeypatch.setattr(run_mod, "make_backend", lambda *a, **k: made.append(1) or FakeBackend())
    monkeypatch.setattr(sys, "argv", ["dflash-ipc", "regenerate", "--backend", "openai", "--url",
                                      "http://127.0.0.1:9/v1", *map(str, args)])
    try:
        run()
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    err = capsys.readouterr().err
    return code, err, bool(made)


# 5: an --out that is not a regular file

def test_a_device_or_fifo_as_out_or_side_file_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    inp = chats(tmp_path)
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    os.mkfifo(tmp_path / "o.state.json")  # the side file of o.jsonl
    for out, named in (("/dev/null", "/dev/null"), (fifo, str(fifo)), (tmp_path / "o.jsonl", "o.state.json")):
        code, err, made = cli(monkeypatch, capsys, "--input", inp, "--out", out)
        assert code == 2 and not made and "Traceback" not in err, err
        assert err.startswith("error: ") and named in err and err.count("\n") == 1, err
        assert "not a regular file" in err
    assert not os.path.exists("/dev/null.rejects.jsonl") and not os.path.exists("/dev/null.state.json")
    assert not (tmp_path / "o.jsonl").exists()


def test_regen_output_refuses_a_device_itself(tmp_path):
    with pytest.raises(DataError, match=r"^/dev/null: exists and is not a regular file"):
        RegenOutput("/dev/null", {"backend": "fake"})
    assert not os.path.exists("/dev/null.state.json")


# 7: an --out that is one of the inputs

@pytest.mark.parametrize("overwrite", [False, True])
def test_out_equal_to_the_input_is_refused_and_the_input_kept(tmp_path, monkeypatch, capsys, overwrite):
    inp = chats(tmp_path)
    before = (tmp_path / "in.jsonl").read_bytes()
    os.symlink(tmp_path / "in.jsonl", tmp_path / "link.jsonl")
    monkeypatch.chdir(tmp_path)
    for out in ("in.jsonl", "./in.jsonl", tmp_path / "link.jsonl", tmp_path / "sub" / ".." / "in.jsonl"):
        extra = ["--overwrite"] if overwrite else []
        code, err, made = cli(monkeypatch, capsys, "--input", inp, "--out", out, *extra)
        assert code == 2 and not made and "is the input" in err and "Traceback" not in err, err
    # In the library too (a Hub input is only known there), before --overwrite deletes anything.
    with pytest.raises(DataError, match="is the input"):
        run_fake(inp, tmp_path / "link.jsonl", overwrite=overwrite)
    assert (tmp_path / "in.jsonl").read_bytes() == before
    assert not (tmp_path / "in.state.json").exists() and not (tmp_path / "in.rejects.jsonl").exists()


def test_a_side_file_of_out_equal_to_an_input_is_refused(tmp_path):
    inp = chats(tmp_path, name="o.state.json")  # an input that happens to be o.jsonl's state file
    with pytest.raises(DataError, match=r"o\.state\.json: is the input"):
        run_fake(inp, tmp_path / "o.jsonl", overwrite=True)
    assert (tmp_path / "o.state.json").read_text().count("\n") == 10
    shard_dir = tmp_path / "shards"
    shard_dir.mkdir()
    chats(shard_dir, name="a.jsonl")
    with pytest.raises(DataError, match=r"a\.jsonl: is the input .*a\.jsonl"):  # one shard of a directory input
        run_fake(shard_dir, shard_dir / "a.jsonl", overwrite=True)


def test_an_out_in_a_directory_that_takes_no_new_file_is_refused_even_as_root(tmp_path, monkeypatch, capsys):
    # /sys refuses new files to root too, where a permission check passes: the probe file is
    # what tells (a read-only mount behaves alike).
    from dflash_ipc.run.write_probe import check_takes_new_files
    try:
        check_takes_new_files("/sys")
        pytest.skip("/sys takes new files here")
    except OSError:
        pass
    inp = chats(tmp_path)
    code, err, made = cli(monkeypatch, capsys, "--input", inp, "--out", "/sys/o.jsonl")
    assert code == 2 and not made and "Traceback" not in err, err
    assert err.startswith("error: /sys/o.jsonl: cannot write in /sys (") and err.count("\n") == 1, err
    assert "lock file" not in err  # the probe's answer, before the lock is tried
    with pytest.raises(DataError, match=r"^/sys/o\.jsonl: cannot write in /sys \((?!.*lock file)"):
        RegenOutput("/sys/o.jsonl", {"backend": "fake"})


def test_an_out_a_directory_input_would_read_is_refused(tmp_path, monkeypatch, capsys):
    # The first run would go through, and its rerun would read the output as input.
    shard_dir = tmp_path / "shards"
    (shard_dir / "train").mkdir(parents=True)
    chats(shard_dir / "train", name="a.jsonl")
    for out in (shard_dir / "regen.jsonl", shard_dir / "train" / "more" / "regen.jsonl"):
        code, err, made = cli(monkeypatch, capsys, "--input", shard_dir, "--out", out)
        assert code == 2 and not made and "Traceback" not in err, err
        assert f"{out}: is inside the input directory {shard_dir}, which would read it" in err, err
    with pytest.raises(DataError, match="is inside the input directory"):
        run_fake(shard_dir, shard_dir / "regen.jsonl")
    # A symlink in the directory is read under its own name, wherever it points; one that points
    # to nothing is refused by name as an input (not a FileNotFoundError from deep in the read).
    from dflash_ipc.data.reader import read_as_shard
    os.symlink(tmp_path / "elsewhere.jsonl", shard_dir / "link.jsonl")
    assert read_as_shard(str(shard_dir), str(shard_dir / "link.jsonl"), None)
    with pytest.raises(DataError, match=r"link\.jsonl: a symlink to .*elsewhere\.jsonl, which does not exist"):
        run_fake(shard_dir, tmp_path / "o.jsonl")
    os.unlink(shard_dir / "link.jsonl")
    # What it would not read is fine: a hidden folder, another split than --split's, a non-data name.
    for out, split in ((shard_dir / ".out" / "regen.jsonl", None), (shard_dir / "regen.txt", None),
                       (shard_dir / "regen.jsonl", "train")):
        report = run_fake(shard_dir, out, split=split)
        assert report.complete and report.num_written == 10
        assert run_fake(shard_dir, out, split=split).num_skipped == 10  # and its rerun resumes


# two runs on one --out

def test_a_second_run_on_the_same_out_is_refused_while_the_first_runs(tmp_path, monkeypatch, capsys):
    inp = chats(tmp_path)
    out = tmp_path / "o.jsonl"
    refusals = []

    def second_run(backend):  # mid-run of the first, once some rows are written
        if backend.polls != 3:
            return
        rows_before = out.read_bytes()
        # The command line answers before the model loads; the library before it touches the
        # file, even with --overwrite (which would delete the rows the first run is writing).
        code, err, made = cli(monkeypatch, capsys, "--input", inp, "--out", out, "--overwrite")
        assert code == 2 and not made and "Traceback" not in err, err
        refusals.append(err)
        with pytest.raises(DataError, match="another regenerate is writing it") as e:
            run_fake(inp, out, overwrite=True)
        refusals.append(str(e.value))
        assert out.read_bytes() == rows_before and rows_before.count(b"\n") == 4

    report = run_fake(inp, out, FakeBackend(on_poll=second_run))
    assert report.complete and report.num_written == 10 and len(refusals) == 2
    assert f"{out}: another regenerate is writing it (pid {os.getpid()} holds {tmp_path / 'o.lock'})" in refusals[0]
    # Released at the end; the lock file stays (a directory input skips it), and so does the
    # lock the command line took (the CLI run above was refused, then let its own go).
    assert run_fake(inp, out).num_skipped == 10
    assert (tmp_path / "o.lock").exists() and chats_dir_files(tmp_path) == ["in.jsonl", "o.jsonl"]
    code, err, made = cli(monkeypatch, capsys, "--input", inp, "--out", out, "--overwrite")
    assert code == 0 and made, err
    # A run that fails while opening its output lets the lock go too, and so does one whose
    # loop could not start.
    (tmp_path / "o.state.json").write_text("[]")
    with pytest.raises(DataError):
        run_fake(inp, out)
    (tmp_path / "o.state.json").unlink()
    out.unlink()
    monkeypatch.setattr(run_mod, "_Loop", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        run_fake(inp, out)
    from dflash_ipc.regenerate.out_lock import OutLock
    lock = OutLock(str(out))
    lock.acquire()
    assert lock.held
    lock.release()


def test_the_lock_on_a_filesystem_without_flock_is_a_warning_and_a_failed_pid_write_is_no_error(
        tmp_path, monkeypatch, caplog):
    import errno
    import fcntl
    from dflash_ipc.regenerate import out_lock
    inp = chats(tmp_path)
    real_flock = fcntl.flock

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(out_lock.fcntl, "flock", no_locks)
    with caplog.at_level("WARNING", logger="dflash_ipc.regenerate.out_lock"):
        assert run_fake(inp, tmp_path / "o.jsonl").complete
    assert "does not lock files (No locks available)" in caplog.text
    monkeypatch.setattr(out_lock.fcntl, "flock", real_flock)
    monkeypatch.setattr(out_lock.os, "pwrite", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    lock = out_lock.OutLock(str(tmp_path / "o.jsonl"))
    lock.acquire()  # held without its pid
    assert lock.held
    with pytest.raises(DataError, match=r"pid \? holds"):
        out_lock.OutLock(str(tmp_path / "o.jsonl")).acquire()
    lock.release()
    out_lock.OutLock(str(tmp_path / "o.jsonl")).acquire()


def test_overwrite_that_cannot_remove_the_earlier_output_names_it(tmp_path, monkeypatch):
    inp = chats(tmp_path)
    out = tmp_path / "o.jsonl"
    run_fake(inp, out)
    real_remove = os.remove

    def remove(path):
        if path.endswith("o.rejects.jsonl"):
            raise PermissionError(13, "Permission denied")
        real_remove(path)
    monkeypatch.setattr(output_mod.os, "remove", remove)
    with pytest.raises(DataError, match=r"o\.rejects\.jsonl: cannot remove it for --overwrite \(Permission denied\)"):
        run_fake(inp, out, overwrite=True)
    monkeypatch.setattr(output_mod.os, "remove", real_remove)
    out_ = RegenOutput(str(tmp_path / "p.jsonl"), {"backend": "fake"})
    assert out_.finish(num_rows=None) is False and out_.finish(num_rows=None) is False  # a second call: nothing


def chats_dir_files(directory):
    """The data files a directory input would read."""
    from dflash_ipc.data.reader import InputSource
    return sorted((os.path.basename(f) for f in InputSource(str(directory)).files), key=str)


def test_the_lock_file_is_checked_like_the_side_files(tmp_path):
    inp = chats(tmp_path, name="o.lock")  # an input that happens to be o.jsonl's lock file
    with pytest.raises(DataError, match=r"o\.lock: is the input"):
        run_fake(inp, tmp_path / "o.jsonl")
    assert (tmp_path / "o.lock").read_text().count("\n") == 10


def test_an_input_changed_under_its_path_is_said_on_resume_and_appended_rows_are_not(tmp_path, caplog):
    inp = chats(tmp_path)
    out = tmp_path / "o.jsonl"
    assert run_fake(inp, out).complete
    state = json.loads((tmp_path / "o.state.json").read_text())
    assert [m["file"] for m in state["inputs"]] == [str(inp)] and state["inputs"][0]["size"] == os.path.getsize(inp)
    with open(inp, "a") as f:  # rows appended: the rerun generates them, nothing to say
        f.write(json.dumps({"messages": [{"role": "user", "content": "question 10"}]}) + "\n")
    with caplog.at_level("WARNING", logger="dflash_ipc.regenerate.output"):
        report = run_fake(inp, out)
    assert report.num_skipped == 10 and report.num_written == 1 and "input changed" not in caplog.text
    chats(tmp_path, n=11)  # the same path, other first rows ("question 0" -> same text, so change it)
    rows = (tmp_path / "in.jsonl").read_text().replace("question 0", "another question")
    (tmp_path / "in.jsonl").write_text(rows)
    caplog.clear()
    with caplog.at_level("WARNING", logger="dflash_ipc.regenerate.output"):
        report = run_fake(inp, out)
    assert report.num_skipped == 11  # kept, not refused
    said = [r.getMessage() for r in caplog.records if "input changed" in r.getMessage()]
    assert len(said) == 1 and f"{inp}: its first " in said[0] and "bytes differ" in said[0], said
    assert "--overwrite" in said[0]
    (tmp_path / "in.jsonl").write_text(rows.split("\n", 1)[1])  # shorter
    caplog.clear()
    with caplog.at_level("WARNING", logger="dflash_ipc.regenerate.output"):
        run_fake(inp, out)
    assert "shorter" in caplog.text
    # A state file of an earlier version has no marks: nothing to compare, nothing said.
    state = json.loads((tmp_path / "o.state.json").read_text())
    del state["inputs"]
    (tmp_path / "o.state.json").write_text(json.dumps(state))
    (tmp_path / "in.jsonl").write_text(rows)
    caplog.clear()
    with caplog.at_level("WARNING", logger="dflash_ipc.regenerate.output"):
        run_fake(inp, out)
    assert "input changed" not in caplog.text


# 6: a full disk

@pytest.mark.parametrize("where", ["write", "torn_write", "fsync", "state"])
def test_a_full_disk_is_one_error_line_and_the_rows_written_are_kept(tmp_path, monkeypatch, caplog, where):
    inp = chats(tmp_path)
    ref = tmp_path / "ref.jsonl"
    assert run_fake(inp, ref).complete
    out = tmp_path / "o.jsonl"
    real_write, real_fsync, real_state = os.write, os.fsync, RegenOutput._write_state
    calls = {"n": 0}

    def full(*a):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def is_out(fd):  # os.write and os.fsync are the os module's: only o.jsonl's fd gets the full disk
        return os.readlink(f"/proc/self/fd/{fd}") == str(out)

    def write(fd, data):
        if not is_out(fd):
            return real_write(fd, data)
        calls["n"] += 1
        if calls["n"] <= 4:
            return real_write(fd, data)
        if where == "torn_write" and calls["n"] == 5:
            return real_write(fd, data[:7])  # a short write, then the disk is full
        full()

    if where in ("write", "torn_write"):
        monkeypatch.setattr(output_mod.os, "write", write)
    elif where == "fsync":
        monkeypatch.setattr(output_mod.os, "fsync", lambda fd: full() if is_out(fd) else real_fsync(fd))
    else:  # the state file, once the rows are in (finish)
        monkeypatch.setattr(RegenOutput, "_write_state",
                            lambda self, **kw: full() if kw["complete"] or kw["num_rows"] else real_state(self, **kw))
    with caplog.at_level(logging.WARNING), pytest.raises(OutputFailed) as info:
        run_fake(inp, out)
    kept = 4 if where in ("write", "torn_write") else 10
    assert str(info.value) == f"{out}: no space left on device ({kept} rows kept; rerun to resume)"
    assert info.value.__cause__ is None and "partial" not in caplog.text  # the error line says it all
    assert out.read_bytes().endswith(b"\n") and out.read_bytes().count(b"\n") == kept  # no torn line
    assert json.loads((tmp_path / "o.state.json").read_text())["complete"] is False
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p or ".sorting-" in p]
    monkeypatch.setattr(output_mod.os, "write", real_write)
    monkeypatch.setattr(output_mod.os, "fsync", real_fsync)
    monkeypatch.setattr(RegenOutput, "_write_state", real_state)
    again = run_fake(inp, out)  # space again: the rerun resumes
    assert again.complete and again.num_skipped == kept and out.read_bytes() == ref.read_bytes()


def test_a_full_disk_on_the_command_line_has_no_traceback(tmp_path, monkeypatch, capsys):
    inp = chats(tmp_path)

    real_write, out = os.write, str(tmp_path / "o.jsonl")

    def full(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}") != out:
            return real_write(fd, data)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(output_mod.os, "write", full)
    code, err, made = cli(monkeypatch, capsys, "--input", inp, "--out", tmp_path / "o.jsonl")
    assert code == 2 and made and "Traceback" not in err, err
    assert err.endswith(f"error: {tmp_path / 'o.jsonl'}: no space left on device (0 rows kept; rerun to resume)\n")


# 13: SIGTERM

def test_sigterm_stops_like_ctrl_c_and_restores_the_handler(tmp_path, caplog):
    inp = chats(tmp_path)
    out = tmp_path / "o.jsonl"

    def term_after_two_polls(backend):
        if backend.polls == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    def previous(signum, frame):
        raise AssertionError("the previous handler ran during regenerate")

    old = signal.signal(signal.SIGTERM, previous)
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(SystemExit) as info:
            run_fake(inp, out, FakeBackend(term_after_two_polls))
        assert signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGTERM, old)
    assert info.value.code == 143
    assert "partial, 4 rows written (4 this run)" in caplog.text and "rerun the same command to resume" in caplog.text
    state = json.loads((tmp_path / "o.state.json").read_text())
    assert state["complete"] is False and state["num_done"] == 4 == out.read_bytes().count(b"\n")
    again = run_fake(inp, out)
    assert again.complete and again.num_skipped == 4


def test_a_sigterm_while_the_output_closes_waits_for_it_and_a_second_is_ignored():
    old = signal.getsignal(signal.SIGTERM)
    closed = False
    with pytest.raises(SystemExit) as info:
        with StopOnSigterm() as stop:
            with stop.closing():
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.01)  # the handler runs here: held back, not raised
                closed = True
    assert closed and info.value.code == 143 and signal.getsignal(signal.SIGTERM) is old


def test_sigterm_reaches_a_run_blocked_on_a_queue_at_once(tmp_path):
    """The hf backend with device processes waits in a multiprocessing queue's get (devices.py):
    the SIGTERM must stop the run there, not once the wait is over."""
    import multiprocessing
    import threading
    results = multiprocessing.get_context("spawn").Queue()

    def blocked(backend):
        if backend.polls == 2:
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
            results.get(timeout=30)

    start = time.monotonic()
    try:
        with pytest.raises(SystemExit) as info:
            run_fake(chats(tmp_path), tmp_path / "o.jsonl", FakeBackend(blocked))
    finally:
        results.close()
    assert info.value.code == 143 and time.monotonic() - start < 10
    assert json.loads((tmp_path / "o.state.json").read_text())["num_done"] == 2


def _children(pid):
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return set()
    found = set()
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found.update(int(p) for p in f.read().split())
        except FileNotFoundError:
            pass
    return found


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow  # two device processes load torch and the model: 10-40 s on one core
@pytest.mark.timeout(120)
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads child pids from /proc")
def test_sigterm_with_device_processes_exits_143_and_stops_them(target_dir, tmp_path):
    inp = write_rows(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": f"hello {i} " * (1 + i % 5)}]}
                                             for i in range(200)])
    out = tmp_path / "o.jsonl"
    cmd = [sys.executable, "-m", "dflash_ipc.cli", "regenerate", "--model", target_dir, "--input", inp,
           "--out", str(out), "--devices", "cpu,cpu", "--max-new-tokens", "16", "--max-batch-size", "1"]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    started = set()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            started |= _children(proc.pid)
            if out.exists() and out.read_bytes().count(b"\n") >= 1:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        started |= _children(proc.pid)
        os.kill(proc.pid, signal.SIGTERM)  # the parent only, as docker stop does
        _, err = proc.communicate(timeout=30)
        err = err.decode()
        assert proc.returncode == 143, err[-2000:]
        assert "Traceback" not in err and "partial" in err and "rerun the same command to resume" in err, err[-2000:]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in started):
            time.sleep(0.1)
        assert not any(_alive(p) for p in started)
    finally:
        for pid in [proc.pid, *started]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.wait(10)
    state = json.loads((tmp_path / "o.state.json").read_text())
    lines = out.read_bytes()
    assert state["complete"] is False and lines.endswith(b"\n")
    assert state["num_done"] == lines.count(b"\n")  # the state was written at the stop, not at the start


# 8: the dtype recorded is the one used

def test_the_resolved_dtype_is_recorded_and_compared(target_dir, tmp_path, caplog):
    from regen_helpers import run_hf
    inp = chats(tmp_path, n=3)
    out = tmp_path / "o.jsonl"
    assert run_hf(target_dir, inp, out, OPTIONS).complete  # --dtype auto on CPU: float32
    state_path = tmp_path / "o.state.json"
    assert json.loads(state_path.read_text())["settings"]["dtype"] == "float32"
    again = run_hf(target_dir, inp, out, OPTIONS, dtype="float32")  # the same dtype, named: resumes
    assert again.complete and again.num_skipped == 3
    with pytest.raises(DataError, match=r"made with other settings .*'dtype': \('float32', 'bfloat16'\)"):
        run_hf(target_dir, inp, out, OPTIONS, dtype="bfloat16")  # as a GPU's auto would be
    # A state file of an earlier version holds "auto": unknown, so accepted with a warning,
    # and the resolved dtype is recorded from then on.
    state = json.loads(state_path.read_text())
    state["settings"]["dtype"] = "auto"
    state_path.write_text(json.dumps(state))
    with caplog.at_level(logging.WARNING):
        again = run_hf(target_dir, inp, out, OPTIONS)
    assert again.complete and again.num_skipped == 3
    assert "records dtype 'auto'" in caplog.text and "resuming with float32" in caplog.text
    assert json.loads(state_path.read_text())["settings"]["dtype"] == "float32"
