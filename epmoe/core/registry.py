"""A name -> class registry whose entries are imported only when asked for.

Entries are "module:Class" strings, so registering a backend never imports its optional
dependencies; `get` imports the module then.
"""

from __future__ import annotations

import importlib
from typing import Dict, Generic, Type, TypeVar, Union

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: Dict[str, Union[str, Type[T]]] = {}

    def register(self, name: str, target: Union[str, Type[T]]) -> None:
        self._entries[name] = target

    def names(self) -> list:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> Type[T]:
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {self.names()}")
        target = self._entries[name]
        if isinstance(target, str):
            module, _, attr = target.partition(":")
            target = getattr(importlib.import_module(module), attr)
            self._entries[name] = target
        return target
