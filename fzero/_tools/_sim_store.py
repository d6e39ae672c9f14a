"""The simulated ranks' store directory, locked while its run lives, removed when it ends.

A parent killed by a signal runs no `finally` to remove it; its ranks die with it
(`_rank_process._die_with_parent`) and the lock with them, so the next run removes it. A lock,
not a process id: a `/tmp` shared across PID namespaces (containers) shows other
processes' ids as gone while they run.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from typing import IO

_PREFIX, _LOCK = "fzero-sim-", "lock"


def make_store() -> tuple[str, IO[str]]:
    """A new store directory and its lock, held (forked ranks share it: it is released
    when the parent and every rank have closed it)."""
    _remove_orphaned()
    path = tempfile.mkdtemp(prefix=_PREFIX)
    # Locked under another name, then renamed: a cleaner never sees an unlocked `lock`.
    lock = open(os.path.join(path, ".lock"), "w")  # noqa: SIM115 (held for the run)
    fcntl.flock(lock, fcntl.LOCK_EX)
    os.rename(os.path.join(path, ".lock"), os.path.join(path, _LOCK))
    return path, lock


def remove_store(path: str, lock: IO[str]) -> None:
    shutil.rmtree(path, ignore_errors=True)
    lock.close()


def _remove_orphaned() -> None:
    """Removes the store directories whose lock no run holds."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        lock_path = os.path.join(root, name, _LOCK)
        if not name.startswith(_PREFIX) or not os.path.exists(lock_path):
            continue
        try:
            with open(lock_path) as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: a live run's
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except OSError:  # held, or not ours to read
            continue
