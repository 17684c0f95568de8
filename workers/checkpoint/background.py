"""One piece of work at a time in a daemon thread, its error kept for whoever waits (an async save,
an HF copy): training goes on while it runs, and ``wait`` re-raises what it raised."""

from __future__ import annotations

import threading
from typing import Callable


class Background:
    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` in a thread, once the previous work is done (its error re-raised here)."""
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable, *args) -> None:
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - surfaced by wait()
            self._error = e

    def wait(self) -> None:
        """Block until the work in progress is done; re-raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
