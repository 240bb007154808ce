"""The config classes below JobConfig, found by walking the fields' annotations: for the tests that check every
field is read and listed."""

from __future__ import annotations

import types
import typing

from pydantic import BaseModel

from jetroll.shared.config.job import JobConfig


def models_in(annotation: object) -> list[tuple[type[BaseModel], bool]]:
    """The config classes an annotation holds, each with whether it is a list's element."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, False)]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:  # a tagged member of a discriminated union, or the union itself
        return models_in(args[0])
    if origin is list:
        return [(cls, True) for cls, _ in models_in(args[0])]
    if origin in (typing.Union, types.UnionType):
        return [found for arg in args for found in models_in(arg)]
    return []


def config_classes(root: type[BaseModel] = JobConfig) -> dict[str, type[BaseModel]]:
    found: dict[str, type[BaseModel]] = {}
    todo = [root]
    while todo:
        cls = todo.pop()
        if cls.__name__ not in found:
            found[cls.__name__] = cls
            todo += [sub for f in cls.model_fields.values() for sub, _ in models_in(f.annotation)]
    return found
