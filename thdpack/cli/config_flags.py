"""The build options as flags: one per :class:`~thdpack.offline.config.BuildConfig` field.

``build`` and ``stats`` (on raw input) take them; a flag not given leaves the ``--config`` value.
A flag of thdpack 0.1.0 (``--shard-size-mb``) is an unrecognized argument whose error names its new
name (:class:`ThdpackParser`)."""

from __future__ import annotations

import argparse
import dataclasses

from thdpack.offline.config import RENAMED_IN_0_2, BuildConfig


class ThdpackParser(argparse.ArgumentParser):
    """argparse's parser, whose "unrecognized arguments" error also names the new flag of each old one
    given (``--shard`` -> ``--slice``: :data:`~thdpack.offline.config.RENAMED_IN_0_2`). Subcommand
    parsers are of the same class; unknown arguments reach the top parser's :meth:`parse_args`."""

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{renamed_flags_hint(extras)}")
        return namespace


def renamed_flags_hint(arguments: list[str]) -> str:
    """`` (--shard was renamed to --slice in thdpack 0.2.0)`` for the old flags among ``arguments``
    (``--shard 0/2``, ``--shard=0/2``); ``""`` when there are none."""
    flags = dict.fromkeys(a.split("=", 1)[0] for a in arguments if a.startswith("--"))  # in order, once each
    renames = ", ".join(f"{f} was renamed to {RENAMED_IN_0_2[f]}" for f in flags if f in RENAMED_IN_0_2)
    return f" ({renames} in thdpack 0.2.0)" if renames else ""


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
