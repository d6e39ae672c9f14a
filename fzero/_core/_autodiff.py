"""value_and_grad over pytrees, on torch.autograd (the gradient engine fzero's steps use)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ._tree import PyTree, tree_flatten, tree_unflatten

# A loss as a step calls it: `(params, batch)` -> a real scalar tensor, or to a step a
# pair `(total, weight)` (see `fzero.sharded_step`).
LossFn = Callable[[PyTree, Any], Any]

# Why torch.autograd.grad and not torch.func.grad: fzero's steps need what torch.func's
# transforms refuse or cannot express: saved-tensor hooks (activation checkpointing is
# refused under torch.func.grad), per-unit backward hooks that reduce-scatter a unit's
# gradient as soon as it is complete, and collectives issued from inside backward. The
# user's loss may still use torch.func freely (functional_call, vmap, ...): it is only
# differentiated by the eager engine, on fresh leaf tensors, so nothing the caller holds
# is modified and the step stays a pure function of (state, batch).


@contextlib.contextmanager
def differentiating(what: str, rank: int | None = None) -> Iterator[None]:
    """Gradients on for a computation that differentiates itself, whatever the caller's mode.

    A step takes its own gradients, as `torch.func.grad` does: under a caller's
    `torch.no_grad()` the loss would otherwise record nothing, and the step would apply a
    zero update without a word. Inference mode cannot be left that way (its tensors
    cannot be saved for backward), so it is refused.
    """
    if torch.is_inference_mode_enabled():
        where = "" if rank is None else f"rank {rank}: "
        raise RuntimeError(
            f"{where}{what} differentiates its loss and cannot run under "
            "torch.inference_mode() (tensors made there cannot be saved for backward); call "
            "it outside (torch.no_grad() is fine: gradients are turned on inside)"
        )
    with torch.enable_grad():
        yield


def bad_loss(exc: Exception) -> Exception:
    """Marks `exc` as a loss's returned value failing fzero's checks, raised once the
    forward is done: a step can have every rank raise it together (the call check)."""
    exc.__dict__["fzero_bad_loss"] = True
    return exc


def is_bad_loss(exc: BaseException) -> bool:
    return bool(exc.__dict__.get("fzero_bad_loss", False))


def check_loss(out: Any, what: str = "loss_fn", rank: int | None = None) -> torch.Tensor:
    """Returns `out` if it is a real scalar tensor, else raises naming the problem
    (marked by `bad_loss`)."""
    where = "" if rank is None else f" on rank {rank}"
    if not isinstance(out, torch.Tensor):
        raise bad_loss(
            TypeError(f"{what} must return a scalar tensor, got {type(out).__name__}{where}")
        )
    if out.dim() != 0 or not out.is_floating_point():
        raise bad_loss(
            ValueError(
                f"{what} must return a real scalar tensor (shape ()), got shape "
                f"{tuple(out.shape)} dtype {out.dtype}{where}"
            )
        )
    return out


def check_differentiable(loss: torch.Tensor, what: str, rank: int | None) -> None:
    """Raises (marked by `bad_loss`) if `loss` carries no gradient: computed under
    `torch.no_grad()` or detached, a step would update with zero gradients."""
    if not loss.requires_grad:
        where = "" if rank is None else f"rank {rank}: "
        raise bad_loss(
            ValueError(
                f"{where}{what} does not require grad: it was computed under torch.no_grad() "
                "or detached from the parameters, so its gradient is zero and a step would "
                "still move them (weight decay, momentum). Compute it from the params it is "
                "given, with gradients enabled"
            )
        )


def value_and_grad(
    fn: Callable[..., torch.Tensor],
    tree: PyTree,
    *args: Any,
    what: str = "loss_fn",
    rank: int | None = None,
    frozen: Sequence[bool] | None = None,
    used: set[int] | None = None,
    hooks: Sequence[Sequence[Callable[[torch.Tensor], Any]]] | None = None,
    own: Sequence[tuple[str, torch.Tensor]] = (),
) -> tuple[torch.Tensor, PyTree | None]:
    """`fn(tree, *args)` and its gradient with respect to every leaf of `tree`.

    Gradients are taken whatever the caller's grad mode, as `torch.func.grad` does (a
    `torch.no_grad()` around the call does not turn them off); inference mode is refused.

    Args:
      fn: returns a real scalar tensor.
      tree: the pytree to differentiate by (its tensors are not modified).
      *args: further arguments of `fn`, not differentiated.
      what: the function's name, for error messages.
      rank: this rank, for error messages.
      frozen: per leaf, whether it is frozen: not differentiated, None in `grads`.
      used: if given, the indices of the leaves `fn` used are added to it.
      hooks: per leaf, gradient hooks (`Tensor.register_hook`) run on its gradient.
      own: the module's own parameters the leaves stand in for, by path: a gradient
        reaching one raises (`grads_of`).

    Returns:
      `(value, grads)`: the detached value, and a tree like `tree` with zeros for leaves
      `fn` does not use; `grads` is None when the value does not depend on `tree` at all.
    """
    leaves, treedef = tree_flatten(tree)
    frozen = [False] * len(leaves) if frozen is None else list(frozen)
    inputs = [x.detach() if f else x.detach().requires_grad_() for x, f in zip(leaves, frozen)]
    for x, f, hs in zip(inputs, frozen, hooks or [()] * len(inputs)):
        for hook in () if f else hs:
            x.register_hook(hook)
    with differentiating("value_and_grad", rank):
        out = check_loss(fn(tree_unflatten(treedef, inputs), *args), what, rank)
        if not out.requires_grad:
            return out.detach(), None
        live = [x for x, f in zip(inputs, frozen) if not f]
        found = iter(grads_of(out, live, own, rank))
    grads = []
    for i, (x, f) in enumerate(zip(inputs, frozen)):
        g = None if f else next(found)
        if used is not None and g is not None:
            used.add(i)
        grads.append(None if f else torch.zeros_like(x) if g is None else g)
    return out.detach(), tree_unflatten(treedef, grads)


def grads_of(
    out: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    own: Sequence[tuple[str, torch.Tensor]] = (),
    rank: int | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """`torch.autograd.grad(out, inputs, allow_unused=True)`, raising if the gradient
    also reached one of `own`: the module's own parameters (path, parameter), which the
    step's tensors stand in for. A loss that reads them (an L2 term over
    `model.parameters()`, `model(x)` without `functional_call`) computes with values no
    step trains and sends their gradient where none is applied: silently another
    training. Asking autograd for them too costs nothing where they are not in the graph.

    Raises:
      ValueError: naming the first parameter of `own` the gradient reached, or whose
        `.grad` a backward of the model's own (a reversible layer's) wrote into.
      RuntimeError: such a backward computing with `own`'s meta tensors (a deferred model).
    """
    own = [(path, p) for path, p in own if p.requires_grad]
    where = "" if rank is None else f"rank {rank}: "
    # What `.grad` each holds: a backward the model runs itself inside this one (a
    # reversible layer recomputing its forward and calling `.backward()`) accumulates
    # there, past `torch.autograd.grad`'s answer.
    held = [(p.grad, _version(p.grad)) for _, p in own]  # the tensors: ids are reused
    try:
        found = torch.autograd.grad(out, [*inputs, *(p for _, p in own)], allow_unused=True)
    except RuntimeError as exc:
        # torch's device mismatch ("Tensor on device meta is not on the expected device
        # cpu!", "... found at least two devices, meta and cpu"), not its "metadata".
        meta = next((path for path, p in own if p.is_meta), None)
        if meta is None or not re.search(r"\bmeta\b", str(exc)):
            raise
        raise RuntimeError(
            f"{where}the backward computed with module='s own parameters, on the meta "
            f"device (fzero.init.deferred built them; {meta!r} is one), not with the "
            "tensors the step hands the loss, as a layer does that runs its forward again "
            "inside its backward (a reversible residual calling .backward(): Reformer, "
            f"RevNets), which cannot train under the step. torch said: {exc}"
        ) from exc
    for (path, p), (grad, version) in zip(own, held):
        if p.grad is not grad or _version(p.grad) != version:
            raise ValueError(
                f"{where}a backward the model ran itself, inside the step's backward, sent "
                f"a gradient into .grad of module='s own parameter {path!r}: a layer whose "
                "autograd.Function recomputes its forward and calls .backward() in its "
                "backward (a reversible residual: Hugging Face's Reformer, RevNets). The "
                "step differentiates the tensors it hands the loss, and nothing reaches "
                "them this way: the parameter would train with a zero gradient. Run such "
                "layers with an ordinary backward (plain residuals, or "
                "torch.utils.checkpoint for the memory)"
            )
    for (path, _), g in zip(own, found[len(inputs) :]):
        if g is not None:
            raise ValueError(
                f"{where}the loss's gradient reached module='s own parameter {path!r}, not "
                "the tensor the step hands the loss for it: the loss read the module's "
                "parameters outside functional_call (model.parameters(), an attribute such "
                "as model.layer.weight, or model(x) called directly). Their values are not "
                "the ones trained, and nothing applies their gradient. Read params[path] "
                "from the tree the loss is given, or call the module through "
                "functional_call(module, params, ...)"
            )
    return found[: len(inputs)]


def _version(g: torch.Tensor | None) -> int:
    """A `.grad`'s version counter (an accumulation in place bumps it); -1 for none."""
    return -1 if g is None else g._version


def sparse_gradient(rank: int, leaf: str | None = None) -> TypeError:
    """The error for a sparse gradient in a step (torch's own, from a view's backward,
    names no cause)."""
    what = "a sparse gradient" if leaf is None else f"leaf {leaf!r} has a sparse gradient"
    return TypeError(
        f"rank {rank}: {what} (nn.Embedding or nn.EmbeddingBag with sparse=True, or "
        "F.embedding(..., sparse=True)); fzero reduces gradients in dense flat buffers, so "
        "build the embedding with sparse=False (the same update for SGD: ZeRO has no "
        "counterpart of DDP's sparse all-reduce)"
    )
