"""Every field of JobConfig is read somewhere: a documented knob that nothing reads is a defect.

The matcher is typed, not textual: a read of `rollout.max_new_tokens` is an attribute access `.max_new_tokens` on an
expression the matcher resolves to a RolloutConfig, e.g. `config.rollout.max_new_tokens`, `cfg.max_new_tokens` after
`cfg = self.config.rollout`, `rollout.max_new_tokens` for a parameter `rollout: RolloutConfig`, or `pool.timing` in
`for pool in config.rollout.pools`. So `task.max_new_tokens` (a Task's own budget) does not count. Expressions are
resolved through assignments (flow-insensitive, per function), annotations, `self.x = ...` in any method, loops and
comprehensions, `a or b`, subscripts of list fields, config-class constructors, `model_copy`/`model_validate`, and the
return annotations of config methods and package functions. Reads in config validators do not count; reads inside a
config method or property (`StalenessConfig.eta` reads `mode`) count once that method is itself used.
"""

from __future__ import annotations

import ast
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path

from config_tree import config_classes, models_in
from pydantic import BaseModel

from jetroll.shared.config.job import JobConfig

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("shared", "services", "functions")
VALIDATORS = {"model_validator", "field_validator"}

# fields read only generically, or only by some modes through a path the matcher cannot type; why, per entry
ALLOWED_UNREAD: dict[str, str] = {
    "tasks.kind": "the discriminator of a task entry: pydantic reads it to pick the entry's class (job.py _task_kind)",
}


def dotted_fields(cls: type[BaseModel] = JobConfig, prefix: str = "",
                  path: tuple[type, ...] = ()) -> Iterator[tuple[str, str, str]]:
    """(dotted path, owning class, field) of every field; a class already on the path is not entered again."""
    for name, info in cls.model_fields.items():
        yield prefix + name, cls.__name__, name
        for sub, _ in models_in(info.annotation):
            if sub not in path and sub is not cls:
                yield from dotted_fields(sub, f"{prefix}{name}.", (*path, cls))


class FieldReads:
    """(config class, field) pairs read through typed attribute chains in some Python sources."""

    def __init__(self, classes: dict[str, type[BaseModel]]) -> None:
        self.field_types: dict[str, dict[str, set[str]]] = {
            name: {f: {("list:" if is_list else "") + sub.__name__ for sub, is_list in models_in(info.annotation)}
                   for f, info in cls.model_fields.items()} for name, cls in classes.items()}
        self.method_types: dict[str, dict[str, set[str]]] = {name: {} for name in classes}
        for name, cls in classes.items():
            for attr, member in vars(cls).items():
                function = member.fget if isinstance(member, property) else member
                if isinstance(function, types.FunctionType) and not attr.startswith("__"):
                    returned = typing.get_type_hints(function, vars(sys.modules[cls.__module__])).get("return")
                    self.method_types[name][attr] = {sub.__name__ for sub, _ in models_in(returned)}
        self.config_names = set(classes)
        self.class_defs: dict[str, ast.ClassDef] = {}  # the package's classes, for the methods a subclass inherits
        self.function_types: dict[str, set[str]] = {}
        # by where they happen: None outside config classes, else (config class, method); a method's reads count
        # once the method itself is used
        self.reads: dict[tuple[str, str] | None, set[tuple[str, str]]] = {}

    def scan(self, sources: dict[str, str]) -> set[tuple[str, str]]:
        trees = {path: ast.parse(text, path) for path, text in sources.items()}
        for tree in trees.values():
            self._holders(tree)
        for tree in trees.values():  # functions anywhere that return a config class (load_config, ...)
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
                    if types_ := self._annotation(node.returns):
                        self.function_types[node.name] = types_
        for tree in trees.values():
            self._module(tree)
        used, todo = set(), [None]
        while todo:
            for read in self.reads.get(todo.pop(), set()) - used:
                used.add(read)
                if read[1] in self.method_types.get(read[0], {}):
                    todo.append(read)
        return used

    def _holders(self, tree: ast.Module) -> None:
        """Classes of the package whose fields hold config sections (a service's own sections, resolved at its
        entry): their fields, and their methods' return types, are typed as a config class's are."""
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef) or node.name in self.config_names:
                continue
            self.class_defs[node.name] = node
            fields = {stmt.target.id: self._annotation(stmt.annotation) for stmt in node.body
                      if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)}
            if any(fields.values()):
                self.field_types[node.name] = {name: types_ for name, types_ in fields.items() if types_}
                self.method_types[node.name] = {
                    stmt.name: self._annotation(stmt.returns) for stmt in node.body
                    if isinstance(stmt, ast.FunctionDef) and stmt.returns is not None}

    # ---- annotations and expressions
    def _annotation(self, node: ast.expr | None) -> set[str]:
        if node is None:
            return set()
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return self._annotation(ast.parse(node.value, mode="eval").body)
        if isinstance(node, ast.Name):
            return {node.id} if node.id in self.field_types else set()
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return self._annotation(node.left) | self._annotation(node.right)
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in ("list", "tuple"):
            element = node.slice.elts[0] if isinstance(node.slice, ast.Tuple) else node.slice
            return {f"list:{t}" for t in self._annotation(element)}
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "dict"
                and isinstance(node.slice, ast.Tuple)):
            return {f"dict:{t}" for t in self._annotation(node.slice.elts[1])}
        return set()

    def _resolve(self, node: ast.expr, names: dict[str, set[str]], owner: dict[str, set[str]]) -> set[str]:
        """The config types (`X` or `list:X`) an expression may hold."""
        if isinstance(node, ast.Name):
            return names.get(node.id, set())
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in owner:
                return owner[node.attr]
            found = set()
            for cls in self._resolve(node.value, names, owner):
                found |= self.field_types.get(cls, {}).get(node.attr, set())
                found |= self.method_types.get(cls, {}).get(node.attr, set())  # a property
            return found
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                if func.id in self.field_types:
                    return {func.id}
                return self.function_types.get(func.id, set())
            if isinstance(func, ast.Attribute):
                if func.attr in ("model_copy", "model_validate"):
                    if isinstance(func.value, ast.Name) and func.value.id in self.field_types:
                        return {func.value.id}
                    return self._resolve(func.value, names, owner)
                if func.attr == "get":  # a dict of config values
                    return {t[5:] for t in self._resolve(func.value, names, owner) if t.startswith("dict:")}
                if isinstance(func.value, ast.Name) and func.value.id in self.field_types:  # `Sections.of(...)`
                    return set(self.method_types[func.value.id].get(func.attr, set()))
                found = set(self.function_types.get(func.attr, set())) if isinstance(func.value, ast.Name) else set()
                for cls in self._resolve(func.value, names, owner):
                    found |= self.method_types.get(cls, {}).get(func.attr, set())
                return found
            return set()
        if isinstance(node, ast.BoolOp):
            return set().union(*(self._resolve(v, names, owner) for v in node.values))
        if isinstance(node, ast.IfExp):
            return self._resolve(node.body, names, owner) | self._resolve(node.orelse, names, owner)
        if isinstance(node, ast.Subscript):
            return {t[5:] for t in self._resolve(node.value, names, owner) if t.startswith(("list:", "dict:"))}
        if isinstance(node, ast.NamedExpr):
            return self._resolve(node.value, names, owner)
        return set()

    def _elements(self, iterable: ast.expr, names: dict[str, set[str]], owner: dict[str, set[str]]) -> set[str]:
        return {t[5:] for t in self._resolve(iterable, names, owner) if t.startswith("list:")}

    # ---- bindings: flow-insensitive, iterated to a fixed point
    def _bind(self, target: ast.expr, types_: set[str], names: dict[str, set[str]], owner: dict[str, set[str]],
              self_attrs: dict[str, set[str]] | None) -> bool:
        if not types_:
            return False
        if isinstance(target, ast.Name):
            store, key = names, target.id
        elif (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
              and self_attrs is not None):
            store, key = self_attrs, target.attr
        else:
            return False
        before = len(store.get(key, set()))
        store.setdefault(key, set()).update(types_)
        return len(store[key]) != before

    def _bindings(self, body: list[ast.AST], names: dict[str, set[str]], owner: dict[str, set[str]],
                  self_attrs: dict[str, set[str]] | None) -> None:
        nodes = [n for stmt in body for n in ast.walk(stmt)]
        changed = True
        while changed:
            changed = False
            for node in nodes:
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        changed |= self._bind(target, self._resolve(node.value, names, owner), names, owner,
                                              self_attrs)
                elif isinstance(node, ast.AnnAssign):
                    types_ = self._annotation(node.annotation)
                    if node.value is not None:
                        types_ |= self._resolve(node.value, names, owner)
                    changed |= self._bind(node.target, types_, names, owner, self_attrs)
                elif isinstance(node, ast.NamedExpr):
                    changed |= self._bind(node.target, self._resolve(node.value, names, owner), names, owner, None)
                elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
                    target, iterable = node.target, node.iter
                    is_enumerate = (isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Name)
                                    and iterable.func.id == "enumerate" and isinstance(target, ast.Tuple))
                    if is_enumerate:
                        target, iterable = target.elts[1], iterable.args[0]
                    changed |= self._bind(target, self._elements(iterable, names, owner), names, owner, None)
                elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                    for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
                        annotation = getattr(arg, "annotation", None)
                        changed |= self._bind(ast.Name(arg.arg), self._annotation(annotation), names, owner, None)

    # ---- modules, classes, functions
    def _module(self, tree: ast.Module) -> None:
        module_names: dict[str, set[str]] = {}
        top = [s for s in tree.body if not isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
        self._bindings(top, module_names, {}, None)
        self._record(top, module_names, {}, None)
        for stmt in tree.body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                self._function(stmt, module_names, {}, None)
            elif isinstance(stmt, ast.ClassDef):
                self._class(stmt, module_names)

    def _class(self, node: ast.ClassDef, module_names: dict[str, set[str]]) -> None:
        self_attrs: dict[str, set[str]] = {}
        for stmt in node.body:  # class-level annotations (dataclasses, msgspec structs)
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if types_ := self._annotation(stmt.annotation):
                    self_attrs.setdefault(stmt.target.id, set()).update(types_)
        methods = [s for s in node.body if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef)]
        own = {m.name for m in methods}
        for base in node.bases:  # an inherited method reads the fields as this class types them
            if isinstance(base, ast.Name) and base.id in self.class_defs:
                methods += [s for s in self.class_defs[base.id].body
                            if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef) and s.name not in own]
        for _ in range(2):  # a method may bind self.x from another's self.y
            for method in methods:
                self._function(method, module_names, self_attrs, node.name, record=False)
        for method in methods:
            self._function(method, module_names, self_attrs, node.name)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef, module_names: dict[str, set[str]],
                  self_attrs: dict[str, set[str]], class_name: str | None, record: bool = True) -> None:
        decorators = {d.func.id if isinstance(d, ast.Call) and isinstance(d.func, ast.Name) else
                      d.id if isinstance(d, ast.Name) else "" for d in node.decorator_list}
        if decorators & VALIDATORS:
            return
        names = {k: set(v) for k, v in module_names.items()}
        if class_name in self.config_names:  # a config method's reads count once it is used; a holder's at once
            names["self"] = {class_name}
        self._bindings([node], names, self_attrs, self_attrs if class_name is not None else None)
        if record:
            self._record(node.body, names, self_attrs, (class_name, node.name) if "self" in names else None)

    def _record(self, body: list[ast.stmt], names: dict[str, set[str]], owner: dict[str, set[str]],
                context: tuple[str, str] | None) -> None:
        """Field reads, and uses of config methods and properties."""
        for stmt in body:
            for node in ast.walk(stmt):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    attr, receiver = node.attr, node.value
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                      and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
                    attr, receiver = node.args[1].value, node.args[0]
                else:
                    continue
                for cls in self._resolve(receiver, names, owner):
                    if attr in self.field_types.get(cls, {}) or attr in self.method_types.get(cls, {}):
                        self.reads.setdefault(context, set()).add((cls, attr))


def package_sources() -> dict[str, str]:
    return {str(path.relative_to(ROOT)): path.read_text() for package in PACKAGES
            for path in sorted((ROOT / package).rglob("*.py"))}


def unread_fields(sources: dict[str, str]) -> list[str]:
    reads = FieldReads(config_classes()).scan(sources)
    return [dotted for dotted, cls, name in dotted_fields() if (cls, name) not in reads]


def test_every_config_field_is_read() -> None:
    unread = unread_fields(package_sources())
    assert not [f for f in unread if f not in ALLOWED_UNREAD], f"config fields nothing reads: {unread}"
    assert not [f for f in ALLOWED_UNREAD if f not in unread], "allowed as unread, but read: drop it from the list"


def reads_in(source: str) -> set[tuple[str, str]]:
    return FieldReads(config_classes()).scan({"synthetic.py": source})


def test_the_matcher_types_the_receiver() -> None:
    """`.max_new_tokens` counts for rollout.max_new_tokens only on something the matcher knows is a RolloutConfig."""
    field = ("RolloutConfig", "max_new_tokens")
    unread = [
        "def f(task):\n    return task.max_new_tokens\n",  # a Task's own budget
        "def f(config: JobConfig):\n    return config.trainer.max_new_tokens\n",  # another section
        "class C(Strict):\n    @model_validator(mode='after')\n    def _check(self: RolloutConfig):\n"
        "        return self.max_new_tokens\n",  # validation is not a use
    ]
    for source in unread:
        assert field not in reads_in(source), source
    read = [
        "def f(config: JobConfig):\n    return config.rollout.max_new_tokens\n",
        "def f(config: JobConfig):\n    cfg = config.rollout\n    return cfg.max_new_tokens\n",
        "def f(rollout: RolloutConfig | None):\n    return rollout.max_new_tokens\n",
        "class S:\n    def __init__(self, config: JobConfig):\n        self.config = config\n"
        "    def g(self):\n        return getattr(self.config.rollout, 'max_new_tokens')\n",
        "def f():\n    return load_config('x.yaml').rollout.max_new_tokens\n"
        "def load_config(path) -> JobConfig: ...\n",
        # through a service's sections, resolved at its entry
        "class Sections:\n    rollout: RolloutConfig\n    @classmethod\n"
        "    def of(cls, config: JobConfig) -> Sections: ...\n"
        "class Worker:\n    def __init__(self, job: JobConfig):\n        self.config = Sections.of(job)\n"
        "    def g(self):\n        return self.config.rollout.max_new_tokens\n",
    ]
    for source in read:
        assert field in reads_in(source), source
    pools = "def f(config: JobConfig):\n    return [(i, p.labels) for i, p in enumerate(config.rollout.pools)]\n"
    assert ("PoolConfig", "labels") in reads_in(pools)
    inherited = ("class Named:\n    entry: Any\n    @property\n    def budget(self):\n"
                 "        return self.entry.max_new_tokens\n"
                 "class Kind(Named):\n    entry: RolloutConfig\n")
    assert ("RolloutConfig", "max_new_tokens") in reads_in(inherited)  # typed by the subclass's field
    faults = ("class Sections:\n    env_faults: dict[str, EnvFaults]\n"
              "def f(sections: Sections, task: str):\n    return sections.env_faults.get(task).delay_s\n")
    assert ("EnvFaults", "delay_s") in reads_in(faults)


def test_a_field_read_nowhere_is_reported() -> None:
    """The package with the callers of RolloutConfig.sample_budget (the one reader of rollout.max_new_tokens) cut
    off: the check names exactly that field, though the unused method still reads it."""
    assert "rollout.max_new_tokens" not in unread_fields(package_sources())
    cut = {path: text if path == "shared/config/rollout.py" else text.replace(".sample_budget(", ".some_other_budget(")
           for path, text in package_sources().items()}
    assert cut != package_sources()
    assert [f for f in unread_fields(cut) if f not in ALLOWED_UNREAD] == ["rollout.max_new_tokens"]
