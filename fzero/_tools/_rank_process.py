"""A forked rank's process: what it sets right before it runs, and how it waits to be killed."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

import torch


def settle_in(parent: int) -> None:
    """What a rank forked from `parent` sets before anything else runs in it."""
    _die_with_parent(parent)
    # GNU OpenMP is not fork-safe: a child of a parent that already ran a multi-threaded
    # op hangs in its first parallel region unless it drops to one thread first.
    torch.set_num_threads(1)
    # Inductor's compile workers are the parent's too: a forked child that hands them a
    # kernel waits for an answer that never comes (the pool's threads were not forked;
    # seen here, a cold compile after in-process ones). Ranks compile in-process.
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None:
        inductor.compile_threads = 1
    _own_tqdm_lock()


def linger(parent: int) -> None:
    """Keeps this rank's sockets open until the parent, holding every rank's word, kills it.

    A rank that exits as soon as it is done closes its sockets under peers still inside
    gloo: one still connecting the mesh (a quick `fn` on the other ranks: about one run in
    five at three ranks) or blocked in a collective after this rank failed would report
    "connection closed by peer" instead of its own result or the cause.
    """
    while os.getppid() == parent:  # an orphan (the parent was killed) leaves on its own
        time.sleep(0.05)
    # Skip atexit handlers and buffered-IO flushes inherited from the parent (pytest,
    # Jupyter): they belong to the parent process.
    os._exit(0)


def _own_tqdm_lock() -> None:
    """Gives this forked rank's tqdm bars a lock of its own.

    The lock a rank inherits from a parent that has made a bar (torch.fx makes one for
    every graph it runs, so any parent that compiled) is a semaphore shared with the
    parent and every sibling. torch.fx takes it many times a compile; a rank killed while
    holding it (its peer failed) would leave the parent's next compile, and every later
    rank's, waiting for it forever.
    """
    std = sys.modules.get("tqdm.std")
    if std is None:
        return  # a rank that imports tqdm makes its own lock
    classes = [std.tqdm]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        if cls is std.tqdm or "_lock" in vars(cls):
            cls.set_lock(threading.RLock())


def _die_with_parent(parent: int) -> None:
    """Has the kernel kill this rank when the parent dies (Linux): a parent killed by a
    signal runs no `finally` to kill its ranks, and one computing or waiting would go on
    for its loop's length or the collective timeout. Elsewhere `linger` watches."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the request was made
        os._exit(1)
