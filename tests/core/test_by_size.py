"""`fzero.units.by_size`: units of at least a size, runs of small siblings joined."""

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fzero
from fzero._core._layout import build_layout


def sizes(**numels: int) -> dict[str, torch.Tensor]:
    """A flat parameter dict, in the order given ("a__b" spells the path "a.b")."""
    return {k.replace("__", "."): torch.zeros(n) for k, n in numels.items()}


def test_a_flat_sequential_of_small_blocks_is_cut_into_runs() -> None:
    # Before: no prefix of a flat Sequential reaches 10 blocks' size, so everything was
    # the root unit (gathered whole before the forward at stage 3).
    model = nn.Sequential(*(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(25)))
    params = dict(model.named_parameters())
    block = 16 + 72
    blocks = fzero.units.by_module(model, nn.Sequential)
    blocks = [b for b in blocks if "." not in b]  # the 25 blocks, not their parents
    assert fzero.units.by_size(params, 10 * block) == fzero.units.grouped(blocks, 10)[:2]
    assert fzero.units.by_size(params, 10 * block - 1) == fzero.units.grouped(blocks, 10)[:2]
    assert fzero.units.by_size(params, block) == blocks


def test_siblings_follow_the_dicts_order_not_optrees_sorted_one() -> None:
    # optree flattens these keys as 0, 1, 10, 11, 2, ...: runs in that order would join
    # layers far apart in the forward.
    params = {f"{i}.w": torch.zeros(10) for i in range(12)}
    assert fzero.units.by_size(params, 30)[-1] == ("9", "10", "11")
    nested = {"layers": [{"w": torch.zeros(10)} for _ in range(12)]}
    assert fzero.units.by_size(nested, 30)[-1] == ("layers.9", "layers.10", "layers.11")


def test_a_unit_breaks_a_run_and_a_short_tail_stays_in_the_root() -> None:
    params = sizes(a__x__w=10, a__y__w=10, a__big__w=50, a__z__w=10, a__t__w=10, a__u__w=5)
    assert fzero.units.by_size(params, 20) == [("a.x", "a.y"), "a.big", ("a.z", "a.t")]


def test_a_child_holding_a_unit_ends_a_run_and_its_rest_goes_up() -> None:
    # b's 30 make a unit; its bias (2) is left between units: not joined with a and c.
    params = sizes(a__w=10, b__big__w=30, b__bias=2, c__w=10, d__w=10)
    assert fzero.units.by_size(params, 20) == ["b.big", ("c", "d")]


def test_a_run_of_every_child_is_the_parent_itself() -> None:
    params = sizes(blk__a__w=10, blk__b__w=10, blk__bias=1, other__c__w=4)
    assert fzero.units.by_size(params, 20) == ["blk"]
    # With a third child, the first two are a run of their own.
    params = sizes(blk__a__w=10, blk__b__w=10, blk__c__w=1)
    assert fzero.units.by_size(params, 20) == [("blk.a", "blk.b")]
    # At the top the parent is the root: no unit.
    assert fzero.units.by_size(sizes(a__w=10, b__w=10), 20) == []


@st.composite
def trees(draw: Any, depth: int = 3) -> dict[str, Any]:
    """Nested dicts of tensors under names in no sorted order, some empty tensors."""
    names = draw(st.lists(st.sampled_from(["3", "10", "a", "B", "0", "z"]), unique=True))
    out: dict[str, Any] = {}
    for name in names or ["w"]:
        if depth and draw(st.booleans()):
            out[name] = draw(trees(depth - 1))
        else:
            out[name] = torch.zeros(draw(st.integers(0, 40)))
    return out


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in tree.items():
        out |= flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


@pytest.mark.slow
@settings(max_examples=200)
@given(trees(), st.integers(1, 120), st.booleans())
def test_units_are_valid_large_enough_runs_of_siblings_and_the_root_keeps_only_small_prefixes(
    tree: dict[str, Any], min_params: int, nested: bool
) -> None:
    params = flat(tree)
    units = fzero.units.by_size(tree if nested else params, min_params)
    layout = build_layout(params, 2, units=units)  # a valid `units=`: no overlap, all used
    # Every unit holds at least min_params of its own (no inner unit's).
    for unit in layout.units:
        if unit:
            assert layout.unit_numel(unit) >= min_params, (unit, units)
    # A group's members are consecutive siblings, in the order the tree was built in.
    prefixes = [".".join(p.split(".")[:k]) for p in params for k in range(1, p.count(".") + 1)]
    prefixes = list(dict.fromkeys(prefixes))
    for unit in units:
        if isinstance(unit, tuple):
            parents = {m.rpartition(".")[0] for m in unit}
            assert len(parents) == 1, unit
            kids = [p for p in prefixes if p.rpartition(".")[0] in parents]
            at = kids.index(unit[0])
            assert tuple(kids[at : at + len(unit)]) == unit, (unit, kids)
    # A group's members hold no unit of their own.
    for unit in units:
        for m in unit if isinstance(unit, tuple) else ():
            inner = [u for u in layout.units if u.startswith(m + ".")]
            assert not inner, (m, inner)
    # A prefix whose every leaf went to the root was too small to be a unit itself.
    owner = {s.path: b.unit for b in layout.buckets for s in b.slots}
    for path in params:
        parts = path.split(".")
        for k in range(1, len(parts)):
            under = [q for q in params if q.startswith(".".join(parts[:k]) + ".")]
            if all(owner[q] == "" for q in under):
                assert sum(params[q].numel() for q in under) < min_params, (parts[:k], units)
