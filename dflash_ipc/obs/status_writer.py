"""Where the supervisor's status goes: a terminal keeps one block rewritten in place, a log
file or a pipe gets one line per update.

    writer = StatusWriter(sys.stdout)
    writer.show(["[ 12s] ...", "epoch 1/3 [###...] ..."])   # every status interval

On a terminal (the stream written to is a TTY) the block's lines end with a newline, and the
next `show` moves the cursor back over them and writes the new block there. It does so only
while the block is the last thing written: a log record meanwhile (`InterruptOnLog` calls
`interrupted`) leaves the old block where it is and the next one goes below. What reaches
the terminal past logging (a library printing itself) is not seen, and may be drawn over
once. A line longer than the terminal is wide wraps and is counted in rows; a
width that changed since the block was drawn (the terminal may have rewrapped it), or one
that cannot be asked, leaves it too. Anywhere else the block's lines are joined into one
line, ` | ` between them.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, TextIO

SEPARATOR = " | "


def _is_tty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def _columns_of(stream) -> Callable[[], int | None]:
    """The terminal's width in columns, asked at each write (None: unknown)."""
    def columns() -> int | None:
        try:
            return os.get_terminal_size(stream.fileno()).columns or None
        except (AttributeError, OSError, ValueError):
            return None
    return columns


def _rows(line: str, columns: int | None) -> int:
    """Rows a line of printable ASCII takes on a terminal of `columns` that wraps it."""
    if not columns:
        return 1
    return max(1, -(-len(line) // columns))


class StatusWriter:
    def __init__(self, stream: TextIO, *, tty: bool | None = None,
                 columns: Callable[[], int | None] | None = None) -> None:
        """`tty`, `columns`: what the stream is and how wide (default: asked of the stream)."""
        self.stream = stream
        self.tty = _is_tty(stream) if tty is None else tty
        self._columns = columns or _columns_of(stream)
        self._lock = threading.Lock()
        self._rows_drawn = 0        # rows of the block on screen below the cursor's line; 0: none
        self._drawn_at_columns: int | None = None

    def interrupted(self) -> None:
        """Something else was written: the block on screen stays, the next goes below it."""
        with self._lock:
            self._rows_drawn = 0

    def show(self, lines: list[str]) -> None:
        """Writes one status block: in place on a terminal, else as one line."""
        with self._lock:
            if not self.tty:
                self.stream.write(SEPARATOR.join(lines) + "\n")
            else:
                columns = self._columns()
                back = ""
                if self._rows_drawn and columns is not None and columns == self._drawn_at_columns:
                    # to the first column of the block's first row, and clear from there down
                    back = f"\r\x1b[{self._rows_drawn}A\x1b[J"
                self.stream.write(back + "".join(line + "\n" for line in lines))
                self._rows_drawn = sum(_rows(line, columns) for line in lines)
                self._drawn_at_columns = columns
            self.stream.flush()


class InterruptOnLog(logging.Handler):
    """A handler that writes nothing: each record it sees tells the writer that a line went out
    (to the terminal or not: either way the next block is drawn fresh, never over it)."""

    def __init__(self, writer: StatusWriter) -> None:
        super().__init__()
        self.writer = writer

    def emit(self, record: logging.LogRecord) -> None:
        self.writer.interrupted()
