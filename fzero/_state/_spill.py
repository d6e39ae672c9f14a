"""Spill: one rank's offload file on local disk, mapped, with a region per unit.

Tensors are views into a shared mapping of the file, so the state stays a pytree of
ordinary tensors (checkpoints, reports and the optimizer read them as they are) while
the kernel, not the process, holds their bytes: a unit's region is paged in when its
update touches it (read ahead with `prefetch` while the previous unit steps) and dropped
from the process with `release` once it is written (the kernel writes it back behind the
step). The file's blocks are allocated when it is made, so a full disk fails there, with
its OS error, never later as a signal inside a step (docs/design.md, [Note: offload]).
"""

from __future__ import annotations

import mmap
import os
import uuid

import torch

_ALIGN = mmap.PAGESIZE  # regions start on pages: advice is given page by page


class Spill:
    """A file of `sizes[k]` bytes for region k, each region page-aligned, mapped shared.

    The file is unlinked once mapped: it lives as long as the mapping (the tensors that
    view it), and a killed run leaves nothing behind on the disk.
    """

    def __init__(self, directory: str, sizes: list[int], rank: int) -> None:
        """Makes the file under `directory` (created if missing) for `rank`. Raises the
        OSError of a directory that cannot be written or a disk without the room."""
        os.makedirs(directory, exist_ok=True)
        self.starts, total = [], 0
        for n in sizes:
            self.starts.append(total)
            total += -(-max(n, 1) // _ALIGN) * _ALIGN
        self.nbytes = total
        self.path = os.path.join(
            directory, f"fzero-offload-{os.getpid()}-{uuid.uuid4().hex[:8]}-r{rank}"
        )
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(total, 1))  # ENOSPC here, not SIGBUS in a step
            self.map = mmap.mmap(fd, max(total, 1), mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(self.path)
        self._fd = fd  # kept for `drop_cache`; closed with the Spill

    def region(self, k: int) -> tuple[int, int]:
        """Region k's first byte and its length in pages' bytes."""
        end = self.starts[k + 1] if k + 1 < len(self.starts) else self.nbytes
        return self.starts[k], end - self.starts[k]

    def tensor(self, k: int, offset: int, like: torch.Tensor) -> torch.Tensor:
        """A tensor shaped and typed as `like` at byte `offset` of region k, holding
        `like`'s values (written through the mapping)."""
        if like.numel() == 0:  # frombuffer refuses a count of 0: nothing to map anyway
            return torch.empty(like.shape, dtype=like.dtype, device="cpu")
        start = self.starts[k] + offset
        out = torch.frombuffer(self.map, dtype=like.dtype, count=like.numel(), offset=start)
        out = out.view(like.shape)
        out.copy_(like)
        return out

    def prefetch(self, k: int) -> None:
        """Asks the kernel to read region k ahead (it returns at once)."""
        start, length = self.region(k)
        self.map.madvise(mmap.MADV_WILLNEED, start, length)

    def release(self, k: int) -> None:
        """Drops region k's pages from this process; written pages stay in the file."""
        start, length = self.region(k)
        self.map.madvise(mmap.MADV_DONTNEED, start, length)

    def drop_cache(self) -> None:
        """Writes every region back and evicts it from the page cache, so the next read
        comes from the disk itself (a benchmark's cold start)."""
        self.map.flush()
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    def release_all(self) -> None:
        """Drops every region (after something read them all, such as a checkpoint)."""
        self.map.madvise(mmap.MADV_DONTNEED, 0, self.nbytes)
