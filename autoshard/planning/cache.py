"""cache: plans kept by what determines them, in memory and optionally on disk.

The key hashes the traced program (its jaxpr and argument avals), the argument paths,
the mesh, the hardware, the budget, the pins, the donated arguments, the planner's
options and autoshard's own source: identical inputs find the plan solved before, in
this process or (with a cache directory) in any other. Plans are stored as their JSON,
which round-trips exactly, so a hit is a fresh ``Plan``.
"""

from __future__ import annotations

import collections
import os
import pathlib
import tempfile

CACHE_DIR_ENV = "AUTOSHARD_CACHE_DIR"
MAX_IN_MEMORY = 64


def cache_dir(directory: str | os.PathLike | None) -> pathlib.Path | None:
    directory = directory if directory is not None else os.environ.get(CACHE_DIR_ENV)
    return pathlib.Path(directory) if directory else None


class PlanCache:
    """Plan JSON by key: the most recent ``MAX_IN_MEMORY`` in memory, all on disk."""

    def __init__(self, max_entries: int = MAX_IN_MEMORY):
        self.max_entries = max_entries
        self.entries: collections.OrderedDict[str, str] = collections.OrderedDict()

    def get(self, key: str, directory: pathlib.Path | None) -> tuple[str, str] | None:
        """(plan JSON, where it was found: "memory" or "disk"), or None."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key], "memory"
        if directory is not None:
            path = directory / f"{key}.json"
            try:
                text = path.read_text()
            except (FileNotFoundError, OSError):
                return None
            self.remember(key, text)
            return text, "disk"
        return None

    def put(self, key: str, text: str, directory: pathlib.Path | None) -> None:
        self.remember(key, text)
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            # write then rename: a process reading the cache never sees half a plan
            fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, directory / f"{key}.json")

    def remember(self, key: str, text: str) -> None:
        self.entries[key] = text
        self.entries.move_to_end(key)
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)

    def clear(self) -> None:
        self.entries.clear()


PLANS = PlanCache()
