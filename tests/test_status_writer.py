"""The supervisor's status output, byte for byte: a terminal gets one block rewritten in place,
a file or pipe one line per status; a log record between two blocks is never written over."""

import io
import logging

from dflash_ipc.obs.status_line import StatusLine
from dflash_ipc.obs.status_writer import InterruptOnLog, StatusWriter
from statuses import make_status

UP_2 = "\r\x1b[2A\x1b[J"  # to the block's first row, cleared to the end of the screen


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def _writer(stream, columns=200):
    return StatusWriter(stream, columns=lambda: columns)


def test_a_file_gets_one_line_per_status_and_no_control_characters():
    out = io.StringIO()
    writer = _writer(out)
    assert not writer.tty
    line = StatusLine(width=4)
    statuses = [make_status([(4, 0)], total_tokens=400, trained=100 * n, consumed=n) for n in (1, 2, 3)]
    for status in statuses:
        writer.show(line.lines(status))
    written = out.getvalue().split("\n")
    assert written[-1] == "" and len(written) == 4  # three lines, each ended
    assert written[0] == ("[   42s]   0% 0/4 batches committed | tgt_rate 0 dft_rate 0 tok_rate 0 tok/s | "
                          "step - loss - | pending 0 leased 0 produced 0 consumed 1 | free slots 0 | "
                          "epoch 1/1 [#...]  25% of 4 batches trained  ETA --")
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_a_terminal_gets_the_block_rewritten_in_place():
    out = FakeTerminal()
    writer = _writer(out)
    writer.show(["a1", "b1"])
    writer.show(["a2", "b2"])
    writer.show(["a3", "b3"])
    assert out.getvalue() == "a1\nb1\n" + UP_2 + "a2\nb2\n" + UP_2 + "a3\nb3\n"


def test_a_log_record_between_two_blocks_is_not_written_over():
    out = FakeTerminal()
    writer = _writer(out)
    logger = logging.getLogger("test_status_writer.interleaved")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    to_terminal = logging.StreamHandler(out)
    watch = InterruptOnLog(writer)
    logger.addHandler(to_terminal)
    logger.addHandler(watch)
    try:
        writer.show(["a1", "b1"])
        logger.warning("target/0 restarted")
        writer.show(["a2", "b2"])  # below the log line
        writer.show(["a3", "b3"])  # in place again: the block was the last thing written
    finally:
        logger.removeHandler(to_terminal)
        logger.removeHandler(watch)
    assert out.getvalue() == "a1\nb1\ntarget/0 restarted\na2\nb2\n" + UP_2 + "a3\nb3\n"


def test_a_line_wider_than_the_terminal_is_counted_in_rows():
    out = FakeTerminal()
    writer = _writer(out, columns=10)
    writer.show(["x" * 25, "y" * 10])  # 3 rows + 1 row (exactly the width: no extra row)
    writer.show(["a", "b"])
    assert out.getvalue() == "x" * 25 + "\n" + "y" * 10 + "\n" + "\r\x1b[4A\x1b[J" + "a\nb\n"


def test_a_terminal_whose_width_changed_gets_a_fresh_block():
    """A resized terminal may have rewrapped the old block: its rows are not known any more."""
    widths = iter([10, 20, 20])
    out = FakeTerminal()
    writer = StatusWriter(out, columns=lambda: next(widths))
    writer.show(["x" * 15])
    writer.show(["a"])
    writer.show(["b"])
    assert out.getvalue() == "x" * 15 + "\n" + "a\n" + "\r\x1b[1A\x1b[J" + "b\n"


def test_a_terminal_of_unknown_width_gets_every_block_below_the_last():
    out = FakeTerminal()
    writer = StatusWriter(out, columns=lambda: None)
    writer.show(["a"])
    writer.show(["b"])
    assert out.getvalue() == "a\nb\n"


def test_tty_is_asked_of_the_stream_written_to():
    class Closed(io.StringIO):
        def isatty(self):
            raise ValueError("I/O operation on closed file")
    assert StatusWriter(FakeTerminal()).tty and not StatusWriter(io.StringIO()).tty
    assert not StatusWriter(Closed()).tty and not StatusWriter(object()).tty


def test_a_real_terminal_is_recognised_with_its_width():
    """A pseudo-terminal 80 columns wide: in place, a 100-character line counted as 2 rows."""
    import fcntl
    import os
    import select
    import struct
    import termios
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    with os.fdopen(slave, "w") as stream:
        try:
            writer = StatusWriter(stream)
            writer.show(["x" * 100, "y"])
            writer.show(["z", "w"])
            written = ""
            # One read may return only part of what the terminal holds: read until the last
            # line has come (or 5 s without more).
            while not written.endswith("w\r\n") and select.select([master], [], [], 5.0)[0]:
                written += os.read(master, 4096).decode()
        finally:
            os.close(master)
    assert writer.tty and "\x1b[3A\x1b[J" in written and written.endswith("w\r\n")


def test_the_supervisor_writes_one_line_per_status_interval_into_a_file(tmp_path):
    """What `dflash-ipc up > up.log` gets: a line for each status polled, and one closing line."""
    import json

    from dflash_ipc.config.load import load_config
    from dflash_ipc.supervise.supervisor import Supervisor
    cfg = load_config(None, [f"run.run_dir={tmp_path}"])
    out = io.StringIO()
    supervisor = Supervisor(cfg, status_out=out)

    class Poller:
        statuses = [make_status([(4, 0)], trained=100, total_tokens=400),
                    make_status([(4, 2)], trained=300, committed_tokens=200, total_tokens=400)]

        def poll(self):
            return self.statuses.pop(0)

    poller = Poller()
    for _ in range(2):
        supervisor._report_status(poller)
    final = make_status([(4, 4)], finished=True)
    with open(cfg.files.final_status, "w") as f:
        json.dump(final.to_json(), f)
    supervisor._final_status()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and all(" | epoch 1/1 [" in line for line in lines), lines
    assert lines[0].endswith(" 25% of 4 batches trained  ETA --")
    assert lines[1].endswith(" 75% of 4 batches trained  ETA --")
    assert lines[2].startswith("done, averages: ") and lines[2].endswith("100% of 4 batches trained  ETA done")
