"""The build options as flags: one per :class:`~thdpack.offline.config.BuildConfig` field.

``build`` and ``stats`` (on raw input) take them; a flag not given leaves the ``--config`` value."""

from __future__ import annotations

import argparse
import dataclasses
import warnings

from thdpack.offline.config import RENAMED, BuildConfig


def add_config_flags(p: argparse.ArgumentParser, only: tuple[str, ...] | None = None, skip=()) -> None:
    """One flag per :class:`BuildConfig` field; default None = "not given" (the config's value stays)."""
    g = p.add_argument_group("build options (override the --config file)")
    for f in dataclasses.fields(BuildConfig):
        if f.metadata.get("internal") or f.name in skip or (only and f.name not in only):
            continue
        flag = "--" + f.name.replace("_", "-")
        kw = dict(default=None, help=_literal_help(f.metadata.get("help")), dest=f.name)
        if f.metadata.get("choices"):
            kw["choices"] = f.metadata["choices"]
        if f.name == "input":
            kw["nargs"] = "+"
            kw["metavar"] = "PATH"
        if isinstance(f.default, bool):
            g.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        if f.metadata.get("type") is float:
            kw["type"] = float
            kw["metavar"] = "X"
        elif f.type in ("int", "int | None") or isinstance(f.default, int):
            kw["type"] = int
            kw["metavar"] = "N"
        g.add_argument(flag, **kw)
    for old, new in RENAMED.items():  # the old flag names, still accepted
        if not (new in skip or (only and new not in only)):
            g.add_argument("--" + old.replace("_", "-"), action=_Deprecated, dest=new, type=float, help=argparse.SUPPRESS)


class _Deprecated(argparse.Action):
    """A flag's old name (``--shard``, ``--shard-size-mb``): stores under the new one's ``dest``, with a FutureWarning."""

    def __call__(self, parser, namespace, values, option_string=None):
        warnings.warn(f"{option_string} is deprecated, use --{self.dest.replace('_', '-')}", FutureWarning, stacklevel=2)
        setattr(namespace, self.dest, values)


def _literal_help(text: str | None) -> str | None:
    """``text`` as argparse help: argparse %-formats help strings, so a literal ``%``
    (``{% generation %}`` in the chat_template help) must be doubled."""
    return None if text is None else text.replace("%", "%%")


def build_config(args, *, input_override=None) -> BuildConfig:
    cfg = BuildConfig.from_yaml(args.config) if args.config else BuildConfig()
    changes = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(BuildConfig) if not f.metadata.get("internal")}
    if input_override is not None:
        changes["input"] = input_override
    return cfg.override(**changes)
