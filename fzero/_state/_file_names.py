"""Which tensor of a pretrained file each leaf reads: its name, a base model's prefix, or none.

A checkpoint's names are not always the module's. A base model's file (the hub's GPT-2:
`h.0.attn...`) fills a model with a head (`transformer.h.0.attn...`), and a head's file
(BERT's `bert.encoder...`) a base model; Hugging Face adds or strips the model's
`base_model_prefix` there, and so does `match_names`, finding the one prefix that
lines the names up. A file whose layers hold their weights under other names (what
`transformers` converts on load: fused MoE experts, ViT's attention) must not have those
leaves made afresh by `missing=`: `check_unread` refuses that where the element counts
say so, and otherwise names what it left unread beside what it made afresh.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Collection, Mapping


def match_names(names: Mapping[str, str | None], entries: Collection[str]) -> dict[str, str]:
    """Each leaf path's name in the file (`names`: its own after `key=`; None: not in the
    file), a one-component prefix added or stripped where that, and only that, lines up
    leaves the file lacks with tensors no leaf reads. Leaves without a tensor are left
    out."""
    found = {p: n for p, n in names.items() if n is not None and n in entries}
    absent = {n: p for p, n in names.items() if n is not None and n not in entries}
    unread = set(entries) - set(found.values())
    if not absent or not unread:
        return found
    ways = set()
    for n in absent:  # the leaf has a prefix the file's names lack
        head, _, rest = n.partition(".")
        if rest in unread:
            ways.add(("strip", head))
    for u in unread:  # the file's names have a prefix the leaves lack
        head, _, rest = u.partition(".")
        if rest in absent:
            ways.add(("add", head))
    if len(ways) != 1:  # none, or several: no guess
        return found
    ((how, head),) = ways
    for n, p in absent.items():
        name = n.partition(".")[2] if how == "strip" and n.startswith(head + ".") else None
        name = f"{head}.{n}" if how == "add" else name
        if name in unread:
            found[p] = name
    return found


def check_unread(
    path: str,
    absent: Mapping[str, tuple[int, ...]],
    unread: Mapping[str, tuple[int, ...]],
    names: Mapping[str, str | None],
) -> None:
    """Refuses layers' leaves made afresh by `missing=` beside layers' weights left unread.

    Args:
      path: the file, for messages.
      absent: the leaf paths the file lacks, which `missing=` makes, with their shapes.
      unread: the file's tensors no leaf read, with their shapes.
      names: each leaf path's name in the file's terms; None where `key=` said the file
        has none (an adapter the model adds), which is not checked.

    Matrices (two or more dimensions) of numbered layers (`...layers.3.`) that the file
    lacks, while as many elements of its layers' matrices went unread, are the same
    weights under other names (a renaming or a fusing keeps the count): a ValueError.
    Counts that differ (a checkpoint's old causal masks beside an adapter), or a leaf
    made afresh with the shape of a tensor left unread (an embedding under another
    name), are a warning naming both, as Hugging Face's "were not used" and "newly
    initialized" are. Other tensors left unread (a tied weight's second name, a
    pretraining head) are said nothing of.
    """
    absent = {p: shape for p, shape in absent.items() if names[p] is not None}
    if not absent or not unread:
        return
    layered = {u: s for u, s in sorted(unread.items()) if len(s) >= 2 and _layer(u)}
    made = {names[p] or p: s for p, s in sorted(absent.items()) if len(s) >= 2}
    made = {n: s for n, s in made.items() if _layer(n)}
    if layered and made:
        if _count(layered) == _count(made):
            raise ValueError(
                f"fzero.init.from_file: {path} holds the layers' weights under other names "
                f"than the model's: {len(layered)} of its layers' matrices are read by no "
                f"leaf (e.g. {list(layered)[:3]}), and {len(made)} layer matrices of the "
                f"model, as many elements, are not in it (e.g. {list(made)[:3]}), which "
                "missing= would make afresh. transformers renames (and fuses) some "
                "architectures' weights as it loads them (MoE experts, ViT's attention), "
                "from_file reads tensors by name: pass key= where it is a renaming, or "
                "build the model with transformers' from_pretrained and shard its own "
                "dict(model.named_parameters()) without init="
            )
        _warn(path, list(layered), list(made))
        return
    shapes = set(absent.values())
    alike = sorted(u for u, shape in unread.items() if shape in shapes)
    if alike:
        seen = set(map(unread.get, alike))
        _warn(path, alike, sorted(names[p] or p for p, s in absent.items() if s in seen))


def _warn(path: str, unread: list[str], made: list[str]) -> None:
    warnings.warn(
        f"fzero.init.from_file: {path}: its tensors {unread[:3]} were read by no leaf, "
        f"and missing= made {made[:3]} afresh; if they are the same weights under other "
        "names, pass key= (returning None for a leaf the file is not meant to hold)",
        stacklevel=3,
    )


def _count(shapes: Mapping[str, tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes.values())


def _layer(name: str) -> str | None:
    """The numbered layer a name lies in: up to its first all-digit component."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None
