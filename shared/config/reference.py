"""The job config's reference: every field with its type, default and description, walked from the pydantic classes
that validate it, so it cannot drift from them. `jetroll config` prints it."""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from jetroll.shared.config.job import JobConfig


@dataclass(frozen=True, slots=True)
class FieldDoc:
    path: str  # dotted; `[]` stands for each element of a list: rollout.pools[].engine
    section: str  # the class that declares and documents it
    type: str
    default: str  # "required" when the field has none
    description: str


def field_docs(model: type[BaseModel] = JobConfig, prefix: str = "",
               within: tuple[type[BaseModel], ...] = ()) -> list[FieldDoc]:
    """Every leaf field under `model`, depth first in declaration order. A section that holds its own class again
    (model.warm_start.init_from) is listed once, as a field that names the section it repeats."""
    docs = []
    within = (*within, model)
    for name, info in model.model_fields.items():
        path, sections = f"{prefix}{name}", _sections_in(info.annotation)
        if not sections:
            docs.append(FieldDoc(path, model.__name__, _type_name(info.annotation), _default(info),
                                 info.description or ""))
            continue
        is_list = typing.get_origin(info.annotation) is list
        for section in sections:
            if section in within:
                docs.append(FieldDoc(path, model.__name__, _type_name(info.annotation), _default(info),
                                     info.description or ""))
            else:
                docs += field_docs(section, f"{path}[]." if is_list else f"{path}.", within)
    return docs


def format_reference(docs: list[FieldDoc]) -> str:
    """One block per field: `path  type = default  (section)`, then its description, indented."""
    return "\n".join(f"{doc.path}  {doc.type} = {doc.default}  ({doc.section})\n    {doc.description}"
                     for doc in docs)


def _sections_in(annotation: Any) -> list[type[BaseModel]]:
    """The config classes an annotation holds: X, X | None, list[X], and the variants of a discriminated union."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [section for arg in typing.get_args(annotation) for section in _sections_in(arg)]


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(choice) for choice in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(arg) for arg in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and origin is None:
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _default(info: Any) -> str:
    if info.default is not PydanticUndefined:
        return repr(info.default)
    if info.default_factory is None:
        return "required"
    first, second = info.default_factory(), info.default_factory()
    return repr(first) if first == second else "generated per job"
