"""The one way this plugin replaces a vLLM attribute: recorded, idempotent, reversible.

`replace_attribute` swaps ``owner.name`` for a new value, remembers the original in a registry,
and refuses to stack a second replacement on the first (plugins are loaded several times per
process tree; a double wrap would run the Smurfs glue twice). `original` gives the replaced value
to the wrapper; `restore` undoes a patch (used by the mechanism's own tests).
"""

from __future__ import annotations

from typing import Any

# (id(owner), name) -> (owner, name, original value)
_REGISTRY: dict[tuple[int, str], tuple[Any, str, Any]] = {}


def is_patched(owner: Any, name: str) -> bool:
    return (id(owner), name) in _REGISTRY


def replace_attribute(owner: Any, name: str, new: Any) -> bool:
    """Replace ``owner.name`` by ``new``; return False (and do nothing) if already replaced."""
    key = (id(owner), name)
    if key in _REGISTRY:
        return False
    if name not in vars(owner):
        raise AttributeError(
            f"{getattr(owner, '__qualname__', owner)!s} has no attribute {name!r} of its own to "
            "patch: the vLLM version differs from the one this patch was written for"
        )
    _REGISTRY[key] = (owner, name, vars(owner)[name])
    setattr(owner, name, new)
    return True


def original(owner: Any, name: str) -> Any:
    """The value ``owner.name`` had before it was replaced (raw: staticmethods stay wrapped)."""
    return _REGISTRY[(id(owner), name)][2]


def restore(owner: Any, name: str) -> None:
    key = (id(owner), name)
    if key in _REGISTRY:
        _, _, value = _REGISTRY.pop(key)
        setattr(owner, name, value)
