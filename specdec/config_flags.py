"""Command-line flags derived from typed configs, as vLLM's `EngineArgs.add_cli_args`.

A config is a frozen dataclass; a field that is a flag carries `flag(...)` in its metadata
(the help, and where they differ from what the field implies: the flag's name, choices, and
the conversions between the flag's value and the field's). A field holding another config
is marked `nested()`, and its flags are the nested config's. From the one definition:

- `add_config_args(parser, Config)` adds the flags, their defaults (the field defaults,
  shown by `--help`), types (from the annotations) and choices;
- `config_from_args(Config, args, **given)` builds the config back from a parsed namespace;
- `config_argv(config)` is the argv that gives a child process the same config (the
  launcher's children), each flag whose value differs from its default.

Adding a flag is adding a field (and reading it where it is used). A field without `flag`
is set by code only (derived values, secrets, test switches).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_FLAG_KEY = "specdec_flag"
_NESTED_KEY = "specdec_nested"


@dataclass(frozen=True)
class Flag:
    """How one config field appears on the command line."""

    help: str
    # Default: `--` and the field's name with dashes.
    name: str | None = None
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    # Field value <- flag value (e.g. milliseconds to seconds, JSON to a config).
    to_field: Callable[[Any], Any] | None = None
    # Flag value <- field value: the default `--help` shows and what `config_argv` writes.
    to_flag: Callable[[Any], Any] | None = None
    # The flag's value type where the field's annotation does not tell it (a converted field).
    type: Callable[[str], Any] | None = None
    # Repeatable (`action="append"`): the field holds a tuple of the values.
    repeated: bool = False
    # The command line must give it (a field without a default always must).
    required: bool = False


def flag(help: str, **options: Any) -> dict[str, Flag]:
    """Field metadata that makes a config field a command-line flag."""
    return {_FLAG_KEY: Flag(help, **options)}


def nested() -> dict[str, bool]:
    """Field metadata for a field holding a config whose flags are this config's too."""
    return {_NESTED_KEY: True}


def env_default(name: str, parse: Callable[[str], Any], default: Any) -> Callable[[], Any]:
    """A default factory: the environment variable `name` where it is set and not empty,
    else `default`. Read when a config is built, never at import."""

    def factory() -> Any:
        raw = os.environ.get(name, "").strip()
        return parse(raw) if raw else default

    return factory


def add_config_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                    config_type: type, *, exclude: tuple[str, ...] = ()) -> None:
    """Adds the flags of `config_type` (and of its nested configs) to `parser`, in field
    order. `exclude`: field names left out (a command that sets them itself)."""
    hints = typing.get_type_hints(config_type)
    for field in dataclasses.fields(config_type):
        if field.name in exclude:
            continue
        if field.metadata.get(_NESTED_KEY):
            add_config_args(parser, hints[field.name], exclude=exclude)
            continue
        spec = field.metadata.get(_FLAG_KEY)
        if spec is None:
            continue
        default = _flag_value(spec, _field_default(field))
        options: dict[str, Any] = {"dest": _dest(field.name, spec), "default": default,
                                   "help": spec.help}
        if spec.required or _is_required(field):
            options["required"] = True
        value_type = spec.type or _scalar_type(hints[field.name])
        if value_type is bool and not spec.repeated:
            # A switch that is on by default can be turned off: --no-<name> (vLLM's way).
            options["action"] = argparse.BooleanOptionalAction if default else "store_true"
        else:
            if value_type is not str:
                options["type"] = value_type
            if spec.repeated:
                options["action"] = "append"
                options["default"] = None if options.get("required") else []
            if spec.choices is not None:
                options["choices"] = list(spec.choices)
            if spec.metavar is not None:
                options["metavar"] = spec.metavar
        parser.add_argument(_flag_name(field.name, spec), **options)


def config_from_args(config_type: type, args: argparse.Namespace, **given: Any) -> Any:
    """A `config_type` from the parsed flags; `given`: fields set by the caller instead
    (those without a flag, or computed), each routed to the (nested) config that has it."""
    return build_config(config_type, args, **given)


def build_config(config_type: type, args: argparse.Namespace | None = None,
                 **given: Any) -> Any:
    """A `config_type` from field values named flat, whichever (nested) config holds them
    (`build_config(VerifierConfig, model=..., max_num_seqs=2)`), the rest from the flags
    in `args` where given, else the defaults. A name no config holds is a TypeError."""
    unused = set(given)
    config = _build(config_type, args, given, unused)
    if unused:
        raise TypeError(f"{config_type.__name__} has no field {', '.join(sorted(unused))}")
    return config


def _build(config_type: type, args: argparse.Namespace | None, given: dict[str, Any],
           unused: set[str]) -> Any:
    kwargs: dict[str, Any] = {}
    hints = typing.get_type_hints(config_type)
    for field in dataclasses.fields(config_type):
        if field.name in given:
            kwargs[field.name] = given[field.name]
            unused.discard(field.name)
        elif field.metadata.get(_NESTED_KEY):
            kwargs[field.name] = _build(hints[field.name], args, given, unused)
        elif _FLAG_KEY in field.metadata and hasattr(args, _dest(field.name, field.metadata[_FLAG_KEY])):
            spec = field.metadata[_FLAG_KEY]
            kwargs[field.name] = _field_value(spec, getattr(args, _dest(field.name, spec)))
    return config_type(**kwargs)


def config_argv(config: Any, *, exclude: tuple[str, ...] = ()) -> list[str]:
    """The flags that rebuild `config` in a child process: every flag whose value is not
    its default (so a child's own defaults stay its own), nested configs included."""
    argv: list[str] = []
    for field in dataclasses.fields(config):
        if field.name in exclude:
            continue
        value = getattr(config, field.name)
        if field.metadata.get(_NESTED_KEY):
            argv += config_argv(value, exclude=exclude)
            continue
        spec = field.metadata.get(_FLAG_KEY)
        if spec is None or value == _field_default(field):
            continue
        name = _flag_name(field.name, spec)
        if spec.repeated:
            for item in value:
                argv += [name, str(_flag_value(spec, item))]
        elif isinstance(value, bool) and spec.to_flag is None:
            argv.append(name if value else "--no-" + name[2:])
        elif value is not None:
            argv += [name, str(_flag_value(spec, value))]
    return argv


def _flag_name(field_name: str, spec: Flag) -> str:
    return spec.name or "--" + field_name.replace("_", "-")


def _dest(field_name: str, spec: Flag) -> str:
    """The namespace attribute: the flag's own name (`args.draft_timeout_ms` holds
    milliseconds, as the flag says), which is the field's unless the flag is renamed."""
    return _flag_name(field_name, spec)[2:].replace("-", "_")


def _is_required(field: dataclasses.Field) -> bool:
    """A field without a default is a flag the command line must give."""
    return (field.default is dataclasses.MISSING
            and field.default_factory is dataclasses.MISSING)


def _field_default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None if field.default is dataclasses.MISSING else field.default


def _flag_value(spec: Flag, value: Any) -> Any:
    if value is None or spec.to_flag is None:
        return value
    return spec.to_flag(value)


def _field_value(spec: Flag, value: Any) -> Any:
    if spec.repeated:
        return tuple(_field_value(dataclasses.replace(spec, repeated=False), item)
                     for item in value)
    if value is None or spec.to_field is None:
        return value
    return spec.to_field(value)


def _scalar_type(annotation: Any) -> Any:
    """int for `int | None`, str for `str`, the element type for `tuple[str, ...]`."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return _scalar_type(members[0])
    if typing.get_origin(annotation) is tuple:
        return _scalar_type(typing.get_args(annotation)[0])
    return annotation
