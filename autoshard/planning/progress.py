"""A planning progress display: stages and counts on the terminal, for plans that take
more than a second; silent when stderr is not a terminal."""

from __future__ import annotations

import threading

from rich.console import Console

SHOW_AFTER_S = 1.0


class PlanProgress:
    """``with PlanProgress() as show: show.stage("solving (217 groups)")``."""

    def __init__(self, enabled: bool | None = None):
        self.console = Console(stderr=True)
        self.enabled = self.console.is_terminal if enabled is None else enabled
        self.text = "tracing"
        self.status = None
        self.lock = threading.Lock()
        self.timer = threading.Timer(SHOW_AFTER_S, self._show) if self.enabled else None

    def __enter__(self) -> PlanProgress:
        if self.timer is not None:
            self.timer.daemon = True
            self.timer.start()
        return self

    def _show(self) -> None:
        with self.lock:
            if self.status is None and self.timer is not None:
                self.status = self.console.status(f"autoshard: {self.text}")
                self.status.start()

    def stage(self, text: str) -> None:
        with self.lock:
            self.text = text
            if self.status is not None:
                self.status.update(f"autoshard: {text}")

    def __exit__(self, *exc) -> None:
        with self.lock:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            if self.status is not None:
                self.status.stop()
                self.status = None
