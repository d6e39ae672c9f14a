"""ShardLayout: packing, slicing and greedy placement, checked without any communication."""

from typing import Any

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import fzero
from fzero._core._layout import build_layout
from fzero._core._tree import tree_flatten
from fzero._step._bursts import cuts

# A zero-size leaf at the offset another leaf starts at: once each rank took a 0-d leaf
# (equal loads), the "tensor" layout's greedy placement puts it in rank 0's segment,
# after its leaf, where rank 1's begins.
EQUAL_LOADS = {"a": torch.randn(()), "b": torch.randn(()), "c": torch.randn(0)}

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@st.composite
def trees(draw: Any) -> dict[str, Any]:
    """Flat dicts of awkward leaves: 0-d, 1-element, empty, and mixed float dtypes."""
    n = draw(st.integers(1, 6))
    dtypes = (
        st.sampled_from([torch.float64, torch.float32])
        if draw(st.booleans())
        else st.just(torch.float64)
    )
    out = {}
    for i in range(n):
        shape = draw(shapes)
        out[f"p{i}"] = torch.randn(shape, dtype=draw(dtypes))
    return out


@example(EQUAL_LOADS, 2, "tensor")
@given(trees(), st.integers(1, 8), st.sampled_from(["flat", "tensor"]))
def test_shards_concatenate_to_the_flat_buffer_and_back(tree: dict, n: int, kind: str) -> None:
    layout = build_layout(tree, n, kind)
    flats = layout.flatten(tree)
    for b, bucket in enumerate(layout.buckets):
        shards = [layout.shard(tree, r)[b] for r in range(n)]
        assert all(s.numel() == bucket.shard_numel for s in shards)
        assert torch.equal(torch.cat(shards), flats[b])
    fzero.assert_trees_close(layout.unflatten(flats), tree, rtol=0, atol=0)


@example(EQUAL_LOADS, 2, "tensor")
@given(trees(), st.integers(1, 8), st.sampled_from(["flat", "tensor"]))
def test_a_compiled_steps_cut_gives_every_leaf_from_one_split(
    tree: dict, n: int, kind: str
) -> None:
    """`_step._bursts.cuts`: one split of a bucket's full buffer covers it exactly (its
    padding and gaps pieces of their own) and hands out every leaf."""
    layout = build_layout(tree, n, kind)
    leaves = tree_flatten(tree)[0]
    for bucket, flat in zip(layout.buckets, layout.flatten(tree)):
        sizes, where = cuts(bucket)
        assert sum(sizes) == bucket.full_numel == flat.numel()
        pieces = flat.split(sizes) if sizes else ()
        assert sorted(i for i, _, _ in where) == sorted(s.index for s in bucket.slots)
        for index, k, shape in where:
            assert torch.equal(pieces[k].view(shape), leaves[index])


@given(trees(), st.integers(1, 8))
def test_flat_layout_pads_fewer_than_world_size_elements(tree: dict, n: int) -> None:
    for bucket in build_layout(tree, n, "flat").buckets:
        assert 0 <= bucket.full_numel - bucket.numel < n
        assert bucket.dtype in {x.dtype for x in tree.values()}


@given(trees(), st.integers(1, 8))
def test_tensor_layout_gives_each_rank_whole_tensors(tree: dict, n: int) -> None:
    layout = build_layout(tree, n, "tensor")
    leaves = tree_flatten(tree)[0]
    owned = []
    for r in range(n):
        shard = layout.shard(tree, r)
        pieces = layout.pieces(shard, r)
        paths = layout.piece_paths(r)
        for path, piece in zip(paths, pieces, strict=True):
            assert torch.equal(piece, tree[path])
        owned += paths
        # pieces -> buffers round trip, padding zero
        assert all(torch.equal(a, b) for a, b in zip(layout.from_pieces(pieces, r, shard), shard))
    assert sorted(owned) == sorted(tree)  # every leaf owned by exactly one rank
    # Greedy largest-first balance: no rank exceeds the mean load by more than one leaf.
    for bucket in layout.buckets:
        biggest = max((s.numel for s in bucket.slots), default=0)
        assert bucket.shard_numel <= bucket.numel / n + biggest
    assert len(leaves) == len(owned)


def test_mixed_dtypes_get_one_bucket_each() -> None:
    tree = {"a": torch.zeros(3), "b": torch.zeros(2, dtype=torch.float64), "c": torch.zeros(4)}
    layout = build_layout(tree, 2)
    assert [b.dtype for b in layout.buckets] == [torch.float32, torch.float64]
    assert [b.numel for b in layout.buckets] == [7, 2]


def test_paths_name_nested_leaves() -> None:
    tree = {"layers": [{"w": torch.zeros(1)}, {"w": torch.zeros(1)}], "scale": torch.zeros(())}
    assert build_layout(tree, 1).paths == ("layers.0.w", "layers.1.w", "scale")


def test_a_trainable_leaf_given_as_none_is_named() -> None:
    # autograd.grad(..., allow_unused=True) gives None for a leaf the loss never reached:
    # it was a bare comparison of two tree structures.
    params = {"a": torch.ones(3), "b": torch.ones(2), "c": torch.ones(1)}
    lay = fzero.build_layout(params, 2, frozen=[False, False, True])
    with pytest.raises(ValueError, match=r"grads: leaf 'b' is None \(1 trainable leaves so\)"):
        lay.leaves({"a": torch.ones(3), "b": None, "c": None}, "grads")
    assert lay.leaves({"a": torch.ones(3), "b": torch.ones(2), "c": None})[2] is None  # frozen
    # A None of the parameters' own tree holds no leaf's place.
    lay = fzero.build_layout({"a": None, "b": torch.ones(2), "c": torch.ones(1)}, 2)
    with pytest.raises(ValueError, match=r"grads: leaf 'c' is None"):
        lay.leaves({"a": None, "b": torch.ones(2), "c": None}, "grads")
