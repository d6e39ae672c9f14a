"""Param groups over torch's own state (`from_torch`): a dict per parameter, whose
per-element tensors a flat piece's runs of several groups share as views and whose other
entries (the step count) each run keeps a copy of; and when groups cannot share a piece."""

from __future__ import annotations

from typing import Any

import torch

from ._base import Optimizer

Part = tuple[int, int, int, bool]  # (leaf, first element, end, sliced)


def keeps_dicts(opt: Optimizer) -> bool:
    """Whether `opt` keeps torch's state: a dict per parameter (`from_torch`)."""
    state = opt.init({"p": torch.zeros(2, device="meta")})
    return isinstance(state, dict) and list(state) == ["p"] and isinstance(state["p"], dict)


def check_dict_entries(made: list[Optimizer]) -> str | None:
    """Why the groups' torch state (`from_torch`) needs whole tensors, or None. A flat piece
    holding parameters of several groups keeps one dict for them: its per-element tensors
    are cut into the groups' runs, its other entries (the step count) are shared. Tried
    with two updates of a small tensor per group, groups keeping other entries (momentum
    in one group only) or moving a shared one apart (NAdam's `mu_product` under another
    `momentum_decay`, ASGD's `eta` under another rate) need the tensor layout, and so do
    optimizers that cannot be tried on a small host tensor (`capturable`)."""
    probe, grad = {"p": torch.ones(3)}, {"p": torch.full((3,), 0.5)}
    try:
        states = []
        for opt in made:
            state = opt.update(grad, opt.init(probe), probe)[1]
            states.append(opt.update(grad, state, probe)[1]["p"])
    except Exception as exc:  # not triable on the host
        return f"param_groups over torch's state could not be tried on the host ({exc})"
    first = states[0]
    for k, got in enumerate(states):
        if sorted(got) != sorted(first):
            return (
                f"param_groups: group {k}'s optimizer keeps {sorted(got)} per parameter, "
                f"group 0's {sorted(first)}, which one flat piece holding both cannot"
            )
        moved = [
            key
            for key, v in got.items()
            if not (isinstance(v, torch.Tensor) and v.shape == probe["p"].shape)
            and not _same(v, first[key])
        ]
        if moved:
            return (
                f"param_groups: groups 0 and {k} move the per-parameter {moved} apart, "
                "which one flat piece holding both cannot keep"
            )
    return None


def _shown(v: Any) -> Any:
    return v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return a == b


def dicts_cut(own: list[dict], leaves: list[torch.Tensor], part: list[Part]) -> list[dict]:
    """A group's torch state (`from_torch`'s dict per parameter) for its `part`: a whole
    leaf's dict as it is; a run of a flat piece's elements, its slice of each tensor
    shaped like the piece (a view: torch updates it in place) and copies of the rest."""
    out = []
    for i, lo, hi, sliced in part:
        if not sliced:
            out.append(own[i])
            continue
        n = leaves[i].shape
        out.append({
            key: v[lo:hi] if isinstance(v, torch.Tensor) and v.shape == n
            else v.clone() if isinstance(v, torch.Tensor) else v
            for key, v in own[i].items()
        })  # fmt: skip
    return out


def dicts_merge(
    own: list[dict],
    leaves: list[torch.Tensor],
    part: list[Part],
    new: list[dict],
    k: int,
    shared: dict[tuple[int, str], tuple[int, Any]],
) -> None:
    """Writes what a group's update left (`new`, per part) into the state's dicts: a whole
    leaf's dict becomes torch's; a run's tensors go into the piece's (made, zeros, where
    the update first made them), its other entries (the step count) replace the piece's.
    `k`: this group; `shared`: what the groups before it wrote of a piece's other entries
    this update. Groups leaving them apart (ASGD's `mu` under another `t0`, once past
    `check_dict_entries`'s trial) cannot share the piece, and raise."""
    for (i, lo, hi, sliced), entries in zip(part, new, strict=True):
        if not sliced:
            if entries is not own[i]:
                own[i].clear()
                own[i].update(entries)
            continue
        for key, v in entries.items():
            if not (isinstance(v, torch.Tensor) and v.shape == (hi - lo,)):
                first, before = shared.setdefault((i, key), (k, v))
                if not _same(v, before):
                    raise ValueError(
                        f"param_groups: groups {first} and {k} leave different values of "
                        f"{key!r} ({_shown(before)} and {_shown(v)}) for parameters sharing "
                        "one flat piece, which keeps one; use layout='tensor' (whole "
                        "tensors, a dict each)"
                    )
                own[i][key] = v
                continue
            whole = own[i].get(key)
            if not (isinstance(whole, torch.Tensor) and whole.shape == leaves[i].shape):
                whole = own[i][key] = torch.zeros_like(leaves[i], dtype=v.dtype)
            if whole[lo:hi].data_ptr() != v.data_ptr():  # torch made it anew
                whole[lo:hi].copy_(v)
