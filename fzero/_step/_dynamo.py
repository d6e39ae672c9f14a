"""Dynamo's side of compiled steps: a code object per compiled function, and the
exception a traced function raised, as itself."""

from __future__ import annotations

import ast
import builtins
import types
from typing import Any

import torch


def raised_in_trace(exc: BaseException) -> BaseException | None:
    """The exception a traced function raised (a ValueError of `fzero.gathered`, the
    user's own), rebuilt from dynamo's report of it: with `fullgraph=True` dynamo raises
    `Unsupported` ("Observed exception") carrying only its repr. None where that is not
    what happened, or the repr is not a builtin exception of literal arguments."""
    cause = exc.__cause__
    if not isinstance(cause, torch._dynamo.exc.ObservedException) or not cause.args:
        return None
    said = str(cause.args[0]).removeprefix("raised exception ")
    try:
        call = ast.parse(said, mode="eval").body
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
            return None
        kind = getattr(builtins, call.func.id, None)
        if not (isinstance(kind, type) and issubclass(kind, Exception)) or call.keywords:
            return None
        return kind(*(ast.literal_eval(a) for a in call.args))
    except (SyntaxError, ValueError, TypeError):
        return None


def own_code(method: Any) -> Any:
    """`method` with a code object of its own: torch.compile keeps its compiled graphs,
    and counts recompilations against its limit, per code object, so each step
    function's compiled loss gets its own count (with `fullgraph=True` the limit raises
    rather than falls back to eager)."""
    fn = method.__func__
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{id(method.__self__):x}")
    own = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    return types.MethodType(own, method.__self__)
