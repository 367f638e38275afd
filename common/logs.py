"""The console's log handler (console/settings.py LOGGING's `console`)."""

from __future__ import annotations

import logging
import sys
from typing import TextIO


class ProcessStderrHandler(logging.StreamHandler):
    """A StreamHandler that writes each record to the process's own standard error (`sys.__stderr__`,
    file descriptor 2 as the process started with it), looked up at every record rather than bound once
    when logging is configured.

    `logging.StreamHandler()` binds whatever `sys.stderr` is at configuration time. Where something has
    replaced `sys.stderr` for a while then (a test runner's capture, a worker process's redirection), the
    handler kept that object after it was closed, and every later record failed with "--- Logging
    error --- ValueError: I/O operation on closed file", printed into whatever stderr was current
    (seen under pytest-xdist: `tests/test_cli_mig.py` read it as the CLI's own error output). The
    process's own descriptor 2 is never closed by such a swap, and where nothing swapped it, it is the
    same stream as before."""

    def __init__(self) -> None:
        super().__init__(sys.__stderr__)

    @property
    def stream(self) -> TextIO | None:
        return sys.__stderr__

    @stream.setter
    def stream(self, _value: object) -> None:
        """StreamHandler.__init__ and setStream assign it: the process's stderr is always used."""
