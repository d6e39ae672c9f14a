"""Checkpoints: sharded save, load at any world size and stage, torch state-dict export/import.

Format. A checkpoint is a directory `path` holding versions `v-<step>-<id>/` and a file
`LATEST` naming the committed one. A version holds one file per saving rank,
`rank-<r>-of-<n>.pt`, a `torch.save` of a flat dict of tensors (never any other object),
and `metadata.json` with everything else: format version, world size, stage, step, the
layout (kind, units, per leaf its path, shape, dtype and frozen flag, per bucket its
slots), how the optimizer state is organised, and each file's size and SHA-256. Rank r
writes its slice of every bucket, whatever the stage: parameters, and each elementwise
optimizer-state entry (Adam's moments, momentum buffers, from_torch tensors shaped like
their parameter); per-tensor entries (torch's "step", Adafactor's factors) are written by
the rank holding them, global ones (the step count) by rank 0.

Safety. Every rank writes into `path/.tmp-<id>/` and fsyncs; rank 0 then writes the
metadata, renames the directory to its version name, and replaces `LATEST` with one
atomic rename. A crash anywhere leaves `LATEST` naming the previous, complete checkpoint;
older versions and debris of interrupted saves are deleted only after the switch. (A
rename of `path` itself over the old checkpoint, the other common scheme, has a window
in which neither exists.) Loading checks each file's size and SHA-256 before opening it;
its index is read with `torch.load(map_location="meta", weights_only=True)` (nothing is
unpickled but tensors), and a rank reads only the element ranges it needs, each straight
into its place (`readinto`). All ranks must see the same
filesystem.

Resharding. A checkpoint is addressed by leaf and element range, never by the saving
layout: each new rank rebuilds its slice of every new bucket (stage 3) or the full
buckets (stages 0-2) from the saved ranges that overlap it, and its optimizer pieces the
same way, so any world size, stage, layout kind ("flat" <-> "tensor") and units work.
Per-tensor optimizer state moves between layouts when it is one scalar shared by every
tensor (torch's "step"); otherwise (Adafactor's factors) only between "tensor" layouts
and stage 0, where pieces are whole tensors, and other requests fail with an error.

Failures. Every function here is collective and fails together: an error on any rank
(a full disk, a file that is not what it says) raises on every rank, the same error
(`CheckpointIOError`, an `OSError` with its errno, for the OS's), after the ranks agree on
it; a failed save or export removes its temporary files and leaves the previous file or
checkpoint as it was.

Why not `torch.distributed.checkpoint`: its metadata file is a pickle (loading it
unpickles), its resharding works on DTensor/ShardedTensor placements rather than fzero's
padded flat buckets, and it writes in place without an atomic switch.
"""

from ._dcp import export_dcp as export_dcp
from ._dcp_import import import_dcp as import_dcp
from ._export import export_safetensors as export_safetensors
from ._export import export_torch as export_torch
from ._pretrained import export_pretrained as export_pretrained
from ._save import load as load
from ._save import save as save
from ._schema import CheckpointError as CheckpointError
from ._schema import CheckpointIOError as CheckpointIOError
from ._torch import import_torch as import_torch

__all__ = [
    "CheckpointError",
    "export_dcp",
    "export_pretrained",
    "export_safetensors",
    "export_torch",
    "import_dcp",
    "import_torch",
    "load",
    "save",
]
