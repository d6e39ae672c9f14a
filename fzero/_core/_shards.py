"""Shards: one rank's slice of every flat bucket of a parameter (or gradient) tree."""

from __future__ import annotations

from dataclasses import dataclass

import optree
import torch

from ._layout import ShardLayout
from ._tree import NAMESPACE


@dataclass(frozen=True)
class Shards:
    """Rank `rank`'s 1-D slice of each bucket of `layout`.

    Stage 3 keeps parameters as Shards between steps; `reduce_scatter_grads` returns
    gradients as Shards; `gather_params` turns either back into the full tree. A pytree
    node (namespace "fzero"): its leaves are the buffers, the layout and rank are static.
    """

    buffers: tuple[torch.Tensor, ...]
    layout: ShardLayout
    rank: int

    def pieces(self) -> tuple[torch.Tensor, ...]:
        """The tensors an optimizer updates (see `ShardLayout.pieces`)."""
        return self.layout.pieces(self.buffers, self.rank)

    def replace_pieces(self, pieces: tuple[torch.Tensor, ...]) -> Shards:
        """Shards holding `pieces` in place of the current ones."""
        buffers = self.layout.from_pieces(pieces, self.rank, self.buffers)
        return Shards(buffers, self.layout, self.rank)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{b.numel()}x{b.dtype}" for b in self.buffers)
        return f"Shards(rank={self.rank}/{self.layout.world_size}, {self.layout.kind}, [{sizes}])"


optree.register_pytree_node(
    Shards,
    lambda s: (s.buffers, (s.layout, s.rank)),
    lambda meta, buffers: Shards(tuple(buffers), *meta),
    namespace=NAMESPACE,
)
