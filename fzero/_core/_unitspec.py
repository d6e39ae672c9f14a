"""Unit specs: what `units=` names, and which unit owns each parameter path.

A unit is one path prefix ("blocks.0") or a group of them (("blocks.0", "blocks.1")):
FSDP2's `fully_shard([m1, m2])`, several submodules gathered and reduced as one buffer
without regrouping the model, which would rename its parameters. A prefix covers the
paths it matches on whole dotted components ("layers.1" covers "layers.1.w", not
"layers.10.w"); a leaf belongs to the unit of its longest matching prefix.

Everything after the layout keys a unit by its name: the prefix, or a group's prefixes
joined by "+". Names are only ever looked up, never parsed: a spec round-trips (through
checkpoints, or rebuilt layouts) as `ShardLayout.specs`.
"""

from __future__ import annotations

from collections.abc import Sequence

# One entry of `units=`: a path prefix, or a group of prefixes forming one unit.
UnitSpec = str | Sequence[str]


def covers(prefix: str, path: str) -> bool:
    """Whether `prefix` covers `path` on whole dotted components ("" covers everything)."""
    return not prefix or path == prefix or path.startswith(prefix + ".")


def members_of(units: Sequence[UnitSpec] | None) -> tuple[tuple[str, ...], ...]:
    """Each entry of `units=` as its tuple of prefixes (a lone prefix: a 1-tuple).

    Raises on anything but a sequence of non-empty strings and non-empty sequences of them.
    """
    if units is None:
        return ()
    if isinstance(units, str):
        raise TypeError("units must be a sequence of path prefixes, not one string")
    out = []
    for u in units:
        group = (u,) if isinstance(u, str) else tuple(u) if isinstance(u, (list, tuple)) else None
        if not group or not all(isinstance(p, str) and p for p in group):
            raise ValueError(
                f"a unit must be a non-empty parameter-path prefix or a non-empty tuple of "
                f"them, got {u!r}"
            )
        if len(set(group)) != len(group):
            raise ValueError(f"unit {u!r} names a prefix twice")
        out.append(group)
    return tuple(out)


def name_of(members: Sequence[str]) -> str:
    """A unit's name: its prefix, or its prefixes joined by "+"."""
    return "+".join(members)


def spec_of(members: Sequence[str]) -> UnitSpec:
    """The `units=` entry of a unit: its prefix, or the tuple of its prefixes."""
    return members[0] if len(members) == 1 else tuple(members)


def check(members: tuple[tuple[str, ...], ...], paths: Sequence[str]) -> tuple[str, ...]:
    """The units' names, after checking that every prefix matches a path, belongs to one
    unit only, and that no group holds a prefix inside another of its own."""
    seen: set[str] = set()
    for group in members:
        for p in group:
            if not any(covers(p, q) for q in paths):
                raise ValueError(
                    f"unit {name_of(group)!r}: prefix {p!r} matches no parameter path "
                    f"(paths look like {paths[0]!r})"
                )
            if p in seen:  # members_of refused a prefix twice in one group
                raise ValueError(f"units has duplicates: prefix {p!r} in two units")
            seen.add(p)
        for p in group:
            inner = [q for q in group if q != p and covers(p, q)]
            if inner:
                raise ValueError(
                    f"unit {name_of(group)!r}: prefix {inner[0]!r} lies inside its own {p!r}"
                )
    names = tuple(name_of(g) for g in members)
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"units has duplicates: {dup}")
    return names


def owner_index(members: tuple[tuple[str, ...], ...]) -> list[tuple[str, int]]:
    """(prefix, unit index) pairs, longest prefix first: the first covering a path owns it."""
    pairs = [(p, k) for k, group in enumerate(members) for p in group]
    return sorted(pairs, key=lambda pk: -len(pk[0]))


def owner(path: str, index: list[tuple[str, int]]) -> int | None:
    """The index of the unit owning `path` (`owner_index`), or None (the root)."""
    for prefix, k in index:
        if covers(prefix, path):
            return k
    return None
