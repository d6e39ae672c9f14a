"""`fzero.gathered`'s walk of a tree under compile (`_gathered._walked`): where it answers,
the same part as the general cut of the flattened tree (`subtree`), or no answer; and the
walked part's leaves read and swapped as optree does (`_leaves`, `_swapped`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fzero._core import subtree, tree_flatten, tree_map
from fzero._engine._gathered import _leaves, _swapped, _walked

T = [torch.full((2,), float(i)) for i in range(12)]
TREES: list[Any] = [
    {"layers": [{"w": T[0], "b": T[1]}, {"w": T[2], "b": T[3]}], "scale": T[4]},
    {"0.ln.weight": T[0], "0.ln.bias": T[1], "1.ln.weight": T[2], "10.ln.weight": T[3]},
    {"blocks": {"0.attn": {"w": T[0]}, "0.mlp": {"w": T[1]}}, "head": (T[2], T[3])},
    {"a": T[0], "a.b": {"c": T[1]}, "x": [T[2], (T[3], {"y": T[4]})]},
    {"enc": {"layers": [[T[0], T[1]], [T[2]]]}, "dec.head": T[3]},
]
PATHS = ["layers", "layers.0", "layers.1.w", "scale", "0", "1", "10", "1.ln", "blocks",
         "blocks.0.attn", "blocks.0.mlp.w", "head", "head.1", "a", "a.b", "a.b.c", "x.1.1",
         "x.1.1.y", "enc.layers.0", "enc.layers.1.0", "dec", "dec.head", ""]  # fmt: skip


def _same(a: Any, b: Any) -> bool:
    la, sa = tree_flatten(a)
    lb, sb = tree_flatten(b)
    return sa == sb and all(x is y for x, y in zip(la, lb))


@pytest.mark.parametrize("k", range(len(TREES)))
def test_the_walk_answers_as_the_cut_of_the_whole_tree(k: int) -> None:
    tree, answered = TREES[k], 0
    for path in PATHS:
        try:
            want = subtree(tree, path)
        except ValueError:  # no leaf under it: the walk must not answer either
            assert _walked(tree, path) is None
            continue
        got = _walked(tree, path)
        if got is not None:
            assert _same(got, want), (k, path)
            answered += 1
    assert answered >= 3  # the walk answers the plain cases it exists for


def test_keys_that_are_not_names_go_the_general_way() -> None:
    tree = {1: T[0], 2: {"w": T[1]}}
    assert all(_walked(tree, p) is None for p in ["1", "2", "2.w"])
    assert _walked([T[0], {"x": T[1]}], "1.x") is T[1]


@pytest.mark.parametrize("k", range(len(TREES)))
def test_a_walked_part_has_optrees_leaves_and_map(k: int) -> None:
    """Read without optree, a walked part's leaves come in optree's order (a dict's by
    sorted key, whatever its insertion order) and a map keeps its structure: the units a
    call enters, and the order it enters them in, are the general path's."""
    tree = {"z": TREES[k], "b": [TREES[k]], "a": (T[5], {"q": T[6], "c": T[7]})}
    got, want = _leaves(tree), tree_flatten(tree)[0]
    assert len(got) == len(want) and all(x is y for x, y in zip(got, want))
    halved = _swapped(lambda x: x / 2, tree)
    (got, spec_got) = tree_flatten(halved)
    (want, spec_want) = tree_flatten(tree_map(lambda x: x / 2, tree))
    assert spec_got == spec_want and all(torch.equal(a, b) for a, b in zip(got, want))
    assert list(halved) == list(tree) and list(halved["z"]) == list(TREES[k])


class _Key:
    """A dict key that is no constant a trace can hand a function (`_gathered._route`)."""

    def __lt__(self, other: Any) -> bool:
        return True


@pytest.mark.slow
@pytest.mark.parametrize("k", range(len(TREES) + 1))
def test_the_walk_traced_answers_as_it_does_eagerly(k: int) -> None:
    """Compiled whole (`fullgraph`, as a compiled step traces `fzero.gathered`), the walk
    gives its eager answers: a dict's route worked out once as a constant of the trace,
    and keys that are not all names (one no constant at all) the general way, unbroken."""
    tree = TREES[k] if k < len(TREES) else {_Key(): T[0], 1: T[1], "a": {"b.c": T[2]}}
    walk = torch.compile(lambda t: [_walked(t, p) for p in PATHS], backend="eager", fullgraph=True)
    for path, got, want in zip(PATHS, walk(tree), [_walked(tree, p) for p in PATHS]):
        assert (got is None) == (want is None), path
        if want is not None:
            (lg, sg), (lw, sw) = tree_flatten(got), tree_flatten(want)
            assert sg == sw and all(torch.equal(a, b) for a, b in zip(lg, lw)), path
