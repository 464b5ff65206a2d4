"""A copy of a model with some of its linear layers swapped (int8, packed panels)."""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Callable, Iterable

from torch import nn

__all__ = ["replace_linears"]


def replace_linears(
    model: nn.Module,
    make: Callable[[nn.Linear], nn.Module],
    skip: Iterable[str] = (),
    *,
    select: Callable[[nn.Module], bool] = lambda m: isinstance(m, nn.Linear),
) -> nn.Module:
    """A deep copy of ``model`` with every selected linear replaced by ``make(linear)``.

    ``skip``: module names or ``fnmatch`` patterns of linears to leave as they are; each must
    match at least one selected linear (a typo is an error). The original model is unchanged.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    patterns = [skip] if isinstance(skip, str) else list(skip)
    linears = [name for name, m in model.named_modules() if select(m)]
    for p in patterns:
        if not isinstance(p, str):
            raise TypeError(f"skip must hold module names (str), got {type(p).__name__}")
        if not any(fnmatch.fnmatchcase(name, p) for name in linears):
            raise ValueError(f"skip={p!r} matches no nn.Linear of the model; its linears: "
                             f"{', '.join(linears[:8])}{', ...' if len(linears) > 8 else ''}")  # fmt: skip
    out = copy.deepcopy(model)
    for name in linears:
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            continue
        parent_name, _, child = name.rpartition(".")
        if not child:  # the model itself is a linear
            return make(out)
        parent = out.get_submodule(parent_name)
        setattr(parent, child, make(getattr(parent, child)))
    return out
