"""User code that a run names by import path ("package.module:function": a model or a dataset),
and the operator's allow-list of such paths (--allow-import), checked before anything is imported."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection


class ImportRefused(ValueError):
    """An import path that the operator's allow-list (--allow-import) does not name."""


def import_allowed(path: str, allow_import: Collection[str]) -> bool:
    """Whether `path` ("package.module:function") lies under one of the `allow_import` prefixes:
    a package or module ("mypkg" allows "mypkg:f" and "mypkg.models:f"), or one exact path."""
    module = path.partition(":")[0]
    for prefix in allow_import:
        prefix = prefix.strip().rstrip(".")
        if prefix and (path == prefix or module == prefix or module.startswith(prefix + ".")):
            return True
    return False


def check_import_allowed(path: str, allow_import: Collection[str] | None) -> None:
    """ImportRefused (one line) unless `path` is allowed; None allows every path. Nothing is
    imported to decide: a path a caller sends runs no code of theirs until it is allowed."""
    if allow_import is not None and not import_allowed(path, allow_import):
        allowed = ", ".join(allow_import) or "none (built-ins only)"
        raise ImportRefused(
            f"import path {path[:200]!r} is not allowed here: allowed prefixes {allowed} (--allow-import)"
        )


def resolve_import_path(path: str) -> Callable[..., object]:
    """Import the callable named by `"package.module:attribute"`; ValueError says why it failed.

    The one resolver for user-supplied datasets and models.
    """
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{path!r} is not of the form 'package.module:function'")
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import module {module_name!r} ({err})") from err
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"module {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{path!r} is not callable")
    return target
