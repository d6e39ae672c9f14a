"""Module hooks inside a compiled step's trace: a hooked unit enters the graph where its
submodule runs (`sharded_step(module=, compile=...)`).

The eager engine's `ModuleHooks` are reused as they are; only what they enter changes.
Around the compiled call the hooks are installed on the unit submodules, and dynamo
traces them as it inlines each submodule's call: the pre-hook adds the unit's entry to
the graph there (the compiled loss's `_enter_unit`, as `fzero.gathered` does) and swaps
its views into the submodule, the forward hook puts back what was there. The tree the
loss receives holds, for each leaf of a hooked unit, a *ghost*: an empty tensor of the
leaf's shape and dtype on the meta device, made inside the graph, which
`functional_call` swaps in and the pre-hook swaps out again (docs/design.md,
[Note: compiled steps]). A ghost used anywhere else either fails the trace (a meta
operand beside the batch's tensors) or makes a meta loss, which `check_loss` refuses:
never a value read from memory that holds none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._core import ShardLayout, bad_loss, tree_flatten
from .._engine import Members, ModuleHooks

# What the compiled loss enters a unit with, inside its trace: `unit -> views by path`.
Enter = Callable[[str], dict[str, torch.Tensor]]


class TracedHooks:
    """The engine side of `ModuleHooks` for a compiled loss: `enter` adds a unit's entry
    to the graph being traced (through `enter_unit`, which the compiled loss sets for
    the length of its trace); `leave` has nothing to do
    (the compiler frees the unit's full parameters after their last use, or recomputes
    them for the backward)."""

    def __init__(self, hooked: Mapping[str, Members]) -> None:
        self.hooked = hooked
        self.enter_unit: Enter | None = None

    def installed(self) -> ModuleHooks:
        """The hooks, to install around one compiled call (`with`)."""
        return ModuleHooks(self, self.hooked, traced=True)

    def enter(self, unit: str) -> dict[str, torch.Tensor]:
        if self.enter_unit is None:
            raise RuntimeError(
                f"unit {unit!r}'s submodule ran outside the compiled loss while the step "
                "had its hooks installed"
            )
        return self.enter_unit(unit)

    def computes(self, unit: str) -> None:
        pass

    def leave(self, unit: str, output: Any = None, done: bool = True) -> Any:
        return output


def ghosts(layout: ShardLayout, units: Mapping[str, Members]) -> list[tuple[int, Any, Any]]:
    """Per leaf of the hooked `units`, `(leaf index, shape, dtype)` of its ghost (the
    compute dtype: what the submodule's forward will read)."""
    out = []
    for unit in units:
        for i in layout.unit_buckets(unit):
            b = layout.buckets[i]
            out += [(s.index, s.shape, b.dtype) for s in b.slots]
    return out


def check_loss(out: Any, rank: int) -> None:
    """Raises ValueError (a refused loss: `bad_loss`) where the loss came out on the meta
    device: it computed with a hooked unit's ghost outside the unit's submodule (its
    parameters used directly, or through `fzero.gathered`), so it holds no value."""
    leaves = tree_flatten(out)[0]
    if any(isinstance(x, torch.Tensor) and x.device.type == "meta" for x in leaves):
        raise bad_loss(ValueError(unhooked_use(rank)))


def ghost_beside_tensors(exc: BaseException) -> bool:
    """Whether a trace failed on a meta operand beside tensors of another device (fake
    tensors' device check), the mark of a ghost used outside its submodule."""
    said = str(exc)
    return "meta" in said and ("device" in said.lower() or "Device" in said)


def unhooked_use(rank: int) -> str:
    """What a ghost used outside its submodule's forward means, for the error."""
    return (
        f"rank {rank}: the compiled loss used a parameter of a unit entered by module= "
        "hooks outside that unit's submodule forward (read from the parameter tree, or "
        "through fzero.gathered): compiled, such a unit's leaves are empty meta tensors "
        "until its submodule runs. Read the parameters inside the submodule's forward "
        "(a method other than forward: fzero.register_forward_method(submodule, name)), "
        "or name the unit where it is used (units=), or step eagerly"
    )
