"""Config fields that are also command-line flags: a setting's name, default, help and range
live once, on the config dataclass.

A field made with `setting()` carries a `Setting` in its metadata: help text, an optional
spelling (else ``--`` + the field name, a trailing ``_s`` dropped, ``_`` as ``-``), older
spellings kept as hidden aliases, an environment variable, and a range. A nested config whose
module is not ours to annotate is described by a `Nested` table on the field that holds it
(field name -> `Setting`); its defaults still come from its own dataclass.

- `flags(cls)` lists every setting of a config class, nested ones included;
- `add_flags(parser, flags)` adds them (argparse types check the ranges: a bad value is a
  usage error naming the flag);
- `from_args(cls, args, **given)` builds the config from parsed arguments;
- `to_argv(flags, args)` writes the values that differ from the default as a command line
  (what `pdserve cluster up` passes to its router);
- `check(config)` enforces the ranges on a config built in code (`__post_init__`): a
  ValueError naming the field, the flag and the allowed range.

Standard library only: the CLI builds its parsers from these at every start.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

SETTING = "pdserve.setting"
NESTED = "pdserve.nested"


@dataclass(frozen=True)
class Setting:
    help: str
    flag: str = ""  # "": derived from the field name (`flag_name`)
    aliases: tuple[str, ...] = ()  # older spellings: still accepted, hidden from --help
    env: str = ""  # environment variable that supplies the default when set
    kind: type | None = None  # the value type when the default is None (else its type)
    gt: float | None = None  # ranges, checked by the flag's type and by `check`
    ge: float | None = None
    le: float | None = None
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    # Repeatable items (e.g. CLASS=SECONDS), turned into the field's value by `parse`
    # (ValueError for a bad item); no flag given: the field's default.
    parse: Callable[[list[str]], Any] | None = None
    show: Callable[[Any], str] | None = None  # a repeatable setting's default, for --help
    # A bool field True by default that the flag turns off (`--no-admission`).
    negate: bool = False
    group: str = ""  # the --help section it is listed under ("": the command's own)
    scale: int = 1  # the field's value is the flag's times this (MiB on the command line)

    def range_text(self) -> str:
        parts = []
        if self.gt is not None:
            parts.append(f"> {self.gt:g}")
        if self.ge is not None:
            parts.append(f">= {self.ge:g}")
        if self.le is not None:
            parts.append(f"<= {self.le:g}")
        return " and ".join(parts)

    def problem(self, value: Any, kind: type) -> str | None:
        """Why `value` is not a valid value of this setting, or None."""
        if value is None:
            return None if self.kind is not None else "must be set"
        if self.parse is not None:
            return None
        if kind is bool:
            return None if isinstance(value, bool) else "must be true or false"
        if kind in (int, float):
            if isinstance(value, bool) or not isinstance(value, int | float) or (
                    kind is int and not isinstance(value, int)):
                return f"must be {'an integer' if kind is int else 'a number'}"
            if not math.isfinite(value) or (self.gt is not None and not value > self.gt) or (
                    self.ge is not None and not value >= self.ge) or (
                    self.le is not None and not value <= self.le):
                return f"must be {self.range_text() or 'finite'}"
            return None
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}"
        return None


def setting(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with default `default` whose flag is described by
    ``Setting(help, **kw)``."""
    return dataclasses.field(default=default, metadata={SETTING: Setting(help, **kw)})


@dataclass(frozen=True)
class Nested:
    """On a field holding another config: its settings. `table` names the nested class's
    fields that are flags (for a class in a module we do not annotate); empty: the nested
    class's own `setting()` fields."""

    table: Mapping[str, Setting] = dataclasses.field(default_factory=dict)


def nested(table: Mapping[str, Setting] | None = None) -> dict[str, Nested]:
    """The metadata of a field holding a nested config: ``field(default_factory=...,
    metadata=nested(table))``."""
    return {NESTED: Nested(dict(table or {}))}


def flag_name(field_name: str) -> str:
    """``token_timeout_s`` -> ``--token-timeout``."""
    return "--" + field_name.removesuffix("_s").replace("_", "-")


@dataclass(frozen=True)
class Flag:
    """One setting of a config class, resolved: where it lives and its default."""

    path: tuple[str, ...]  # field names from the top config down to the setting
    owner: type  # the dataclass declaring the field
    setting: Setting
    default: Any
    kind: type

    @property
    def name(self) -> str:
        return self.path[-1]

    @property
    def option(self) -> str:
        return self.setting.flag or flag_name(self.name)

    @property
    def dest(self) -> str:
        return self.option.removeprefix("--").replace("-", "_")

    def env_default(self, env: Mapping[str, str]) -> Any:
        """The argparse default: the environment's value (a string argparse converts with the
        flag's type, so a bad one is a usage error) when set, else the field's default."""
        if self.setting.env and env.get(self.setting.env):
            return env[self.setting.env]
        return self.default


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"setting {f.name} has no default")


def flags(cls: type, _path: tuple[str, ...] = ()) -> list[Flag]:
    """Every setting of config class `cls`, nested configs' included, in field order."""
    out: list[Flag] = []
    for f in dataclasses.fields(cls):
        s = f.metadata.get(SETTING)
        if s is not None:
            out.append(_flag((*_path, f.name), cls, s, _field_default(f)))
            continue
        n = f.metadata.get(NESTED)
        if n is None:
            continue
        # A class as the factory is the nested config's type: not made (its own nested
        # defaults may import what a parser does not need).
        factory = f.default_factory
        inner = factory if isinstance(factory, type) else type(_field_default(f))
        if n.table:
            out += table_flags(inner, n.table, (*_path, f.name))
        else:
            out += flags(inner, (*_path, f.name))
    return out


def table_flags(cls: type, table: Mapping[str, Setting],
                path: tuple[str, ...] = ()) -> list[Flag]:
    """The settings `table` gives fields of `cls` (a class we do not annotate), with their
    defaults from `cls`; TypeError for a name `cls` does not have."""
    by_name = {g.name: g for g in dataclasses.fields(cls)}
    out = []
    for name, sub in table.items():
        if name not in by_name:
            raise TypeError(f"{cls.__name__} has no field {name!r} (renamed? update its "
                            "settings table)")
        out.append(_flag((*path, name), cls, sub, _field_default(by_name[name])))
    return out


def _flag(path: tuple[str, ...], owner: type, s: Setting, default: Any) -> Flag:
    kind = s.kind or (list if s.parse is not None else type(default))
    if s.scale != 1 and default is not None:
        default //= s.scale
    return Flag(path, owner, s, default, kind)


# --------------------------------------------------------------------------- argparse


def _arg_type(fl: Flag) -> Callable[[str], Any]:
    kind, s = fl.kind, fl.setting

    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        problem = s.problem(value, kind)
        if problem:
            raise argparse.ArgumentTypeError(f"{problem}, got {text!r}")
        return value

    convert.__name__ = kind.__name__
    return convert


def _metavar(fl: Flag) -> str:
    if fl.option.endswith("-port"):
        return "PORT"
    if fl.name.endswith("_bytes"):
        return "BYTES"
    if fl.name.endswith("_s") and fl.kind in (int, float):
        return "SECONDS"
    if fl.setting.choices:
        return "{" + ",".join(fl.setting.choices) + "}"
    return {int: "N", float: "X"}.get(fl.kind, fl.dest.upper())


def _item_type(fl: Flag) -> Callable[[str], str]:
    """A repeatable flag's items are checked one by one as they are parsed (usage errors),
    and kept as text (`values` turns the list into the field's value)."""
    parse = fl.setting.parse
    assert parse is not None

    def item(text: str) -> str:
        try:
            parse([text])
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    item.__name__ = "item"
    return item


def add_flags(parser: argparse.ArgumentParser, fls: Iterable[Flag],
              env: Mapping[str, str] | None = None) -> None:
    """One argparse option per flag (and one hidden option per alias), in --help sections
    by `Setting.group`."""
    env = os.environ if env is None else env
    groups: dict[str, argparse._ActionsContainer] = {"": parser}
    for fl in fls:
        s = fl.setting
        if s.group not in groups:
            groups[s.group] = parser.add_argument_group(s.group)
        help_text = s.help.replace("%", "%%")
        if s.parse is not None and s.show is not None:
            help_text += f" (default: {s.show(fl.default)})"
        if s.env:
            help_text += f" (env {s.env})"
        kw: dict[str, Any] = {"dest": fl.dest, "help": help_text}
        if s.negate or fl.kind is bool:
            kw.update(action="store_true", default=False)
        elif s.parse is not None:
            kw.update(action="append", default=[], metavar=s.metavar, type=_item_type(fl))
        else:
            kw.update(type=_arg_type(fl), default=fl.env_default(env), metavar=s.metavar)
            if s.choices:
                kw["choices"] = s.choices
        if "metavar" in kw and kw["metavar"] is None:
            kw["metavar"] = _metavar(fl)
        target = groups[s.group]
        target.add_argument(fl.option, **kw)
        for alias in s.aliases:
            target.add_argument(alias, **{**kw, "help": argparse.SUPPRESS,
                                          "default": argparse.SUPPRESS})


def values(fls: Iterable[Flag], args: argparse.Namespace) -> dict[tuple[str, ...], Any]:
    """Path -> the field value the parsed arguments give (flags not given: their default;
    repeatable ones not given are left out, so the field's own default applies)."""
    out: dict[tuple[str, ...], Any] = {}
    for fl in fls:
        raw = getattr(args, fl.dest, fl.default)
        if fl.setting.negate:
            out[fl.path] = not raw
        elif fl.setting.parse is not None:
            if raw:
                try:
                    out[fl.path] = fl.setting.parse(list(raw))
                except ValueError as exc:
                    raise argparse.ArgumentTypeError(f"{fl.option}: {exc}") from None
        else:
            out[fl.path] = raw if raw is None or fl.setting.scale == 1 else raw * fl.setting.scale
    return out


def from_args(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """An instance of config class `cls` from its flags in `args`; `given`: its fields that
    are not flags (or values that override them). ArgumentTypeError for a bad repeatable
    item; ValueError from the config's own checks."""
    return build(cls, values(flags(cls), args), given)


def build(cls: type, by_path: Mapping[tuple[str, ...], Any], given: Mapping[str, Any]) -> Any:
    """``cls(**given)`` with the values `by_path` gives its fields and nested configs'
    fields (a nested config in `given` is taken as it is)."""
    top, inner = _split(by_path)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name, sub in inner.items():
        if name not in given:
            top[name] = _apply(_field_default(fields[name]), sub)
    return cls(**{**top, **given})


def _split(by_path: Mapping[tuple[str, ...], Any]
           ) -> tuple[dict[str, Any], dict[str, dict[tuple[str, ...], Any]]]:
    top: dict[str, Any] = {}
    inner: dict[str, dict[tuple[str, ...], Any]] = {}
    for path, value in by_path.items():
        if len(path) == 1:
            top[path[0]] = value
        else:
            inner.setdefault(path[0], {})[path[1:]] = value
    return top, inner


def _apply(obj: Any, by_path: Mapping[tuple[str, ...], Any]) -> Any:
    top, inner = _split(by_path)
    for name, sub in inner.items():
        top[name] = _apply(getattr(obj, name), sub)
    return dataclasses.replace(obj, **top)


def to_argv(fls: Iterable[Flag], args: argparse.Namespace) -> list[str]:
    """The flags of `args` that differ from their defaults, as a command line."""
    argv: list[str] = []
    for fl in fls:
        raw = getattr(args, fl.dest, None)
        if fl.setting.negate or fl.kind is bool:
            if raw:
                argv.append(fl.option)
        elif fl.setting.parse is not None:
            argv += [a for item in raw or () for a in (fl.option, str(item))]
        elif raw is not None and raw != fl.default:
            argv += [fl.option, str(raw)]
    return argv


# --------------------------------------------------------------------------- checks


def check(config: Any) -> None:
    """ValueError naming the first setting of `config` (nested tables' included) whose value
    is out of its range."""
    cls = type(config)
    for f in dataclasses.fields(cls):
        s = f.metadata.get(SETTING)
        if s is not None:
            _check_one(cls, f.name, s, getattr(config, f.name), _field_default(f))
            continue
        n = f.metadata.get(NESTED)
        if n is not None and n.table:
            inner = getattr(config, f.name)
            for name, sub in n.table.items():
                _check_one(type(inner), name, sub, getattr(inner, name), None,
                           where=f"{cls.__name__}.{f.name}")


def _check_one(owner: type, name: str, s: Setting, value: Any, default: Any,
               where: str = "") -> None:
    kind = s.kind or (type(default) if default is not None else type(value))
    if s.scale != 1 and isinstance(value, int):
        value //= s.scale
    problem = s.problem(value, kind)
    if problem:
        option = s.flag or flag_name(name)
        raise ValueError(f"{where or owner.__name__}.{name} ({option}) {problem}, "
                         f"got {value!r}")


def defaults(cls: type) -> dict[str, Any]:
    """Flag -> its default, for every setting of `cls` (the surfaces test compares them)."""
    return {fl.option: fl.default for fl in flags(cls)}


__all__ = ["Flag", "Nested", "Setting", "add_flags", "build", "check", "defaults", "flag_name",
           "flags", "from_args", "nested", "setting", "table_flags", "to_argv", "values"]
