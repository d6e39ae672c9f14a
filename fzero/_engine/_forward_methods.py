"""Forward methods: a submodule's method other than `forward` run as its forward, its unit
entered around it (FSDP2's `register_fsdp_forward_method`)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

# The methods registered, by module (the registration lasts as long as the module).
_FORWARD_METHODS: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


def register_forward_method(module: nn.Module, name: str) -> None:
    """Runs `module.<name>` as its forward: where `module` is a unit's submodule under
    `module=` hooks, the unit enters as the method starts and leaves as it returns, and
    under `Precision` its floating-point inputs are cast as a forward's are (FSDP2's
    `register_fsdp_forward_method`). A parent calling `self.text.encode(x)` rather than
    `self.text(x)` otherwise reaches the unit's placeholders, and the step says so.

    Only fzero's hooks run around the method, not the module's other forward hooks.
    Outside a step it is the method as it was. A method that calls the module itself
    (`self(x)`) enters the unit again for that call: at stage 3 one more gather.

    Args:
      module: a submodule a unit names.
      name: the method's name.

    Raises:
      ValueError: if `name` is "forward" or not a method of `module`.
    """
    if name == "forward" or not callable(getattr(type(module), name, None)):
        raise ValueError(
            f"register_forward_method: {name!r} is not a method of {type(module).__name__} "
            "other than forward (forward needs no registration)"
        )
    _FORWARD_METHODS.setdefault(module, set()).add(name)


def forward_methods(module: nn.Module) -> frozenset[str]:
    """The methods of `module` registered to run as its forward."""
    return frozenset(_FORWARD_METHODS.get(module, ()))


Before = Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Any]
After = Callable[[nn.Module, tuple[Any, ...], Any], Any]


class AsForward:
    """For a block, `module.<name>` run between hooks as a forward is: each of `before`
    (torch's `with_kwargs` pre-hook form: it may return new `(args, kwargs)`), the
    method, each of `after` (it may return a new output). An attribute of the instance
    over the class's method (or over one installed before, which it calls); `remove`
    puts back what was there."""

    def __init__(
        self, module: nn.Module, name: str, before: Sequence[Before], after: Sequence[After] = ()
    ) -> None:
        self.module, self.name = module, name
        self.had = module.__dict__.get(name, _NONE)
        method = getattr(module, name)

        def as_forward(*args: Any, **kwargs: Any) -> Any:
            for hook in before:
                changed = hook(module, args, kwargs)
                if changed is not None:
                    args, kwargs = changed
            out = method(*args, **kwargs)
            for hook in after:
                changed = hook(module, args, out)
                out = out if changed is None else changed
            return out

        module.__dict__[name] = as_forward

    def remove(self) -> None:
        if self.had is _NONE:
            self.module.__dict__.pop(self.name, None)
        else:
            self.module.__dict__[self.name] = self.had


_NONE = object()
