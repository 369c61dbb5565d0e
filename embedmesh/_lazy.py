"""A module `__getattr__` (PEP 562) that loads a name on its first use, so that importing
the module does not import what the name needs (orbax, for the checkpoint readers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def lazy_getattr(module: str, **loaders: Callable[[], Any]) -> Callable[[str], Any]:
    """The `__getattr__` of `module`: `name` is `loaders[name]()`, called at each lookup
    (the import it makes is cached by Python); any other name raises the AttributeError
    Python's own lookup raises. A loader imports with an `import` statement of its own, so
    that the layering tests, which read the import statements, see the dependency."""

    def __getattr__(name: str) -> Any:
        loader = loaders.get(name)
        if loader is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return loader()

    return __getattr__
