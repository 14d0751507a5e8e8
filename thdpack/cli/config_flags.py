"""The build options as flags: one per :class:`~thdpack.offline.config.BuildConfig` field.

``build`` and ``stats`` (on raw input) take them; a flag not given leaves the ``--config`` value."""

from __future__ import annotations

import argparse

from thdpack.offline.config import BuildConfig, options


USAGE_LINES = 4  # the longest usage printed above an error


class ThdpackParser(argparse.ArgumentParser):
    """argparse's parser, whose usage above an error stays short (:meth:`format_usage`). Subcommand
    parsers are of the same class."""

    def format_usage(self) -> str:
        """The usage printed above an error: argparse's, or where that runs past :data:`USAGE_LINES` lines (a
        command with every build option as a flag) one line with the positionals and a pointer to ``--help``."""
        usage = super().format_usage()
        if usage.count("\n") <= USAGE_LINES:
            return usage
        positionals = [a.metavar or a.dest for a in self._actions if not a.option_strings]
        return " ".join(["usage:", self.prog, "[options]", *positionals, f"(every option: {self.prog} --help)"]) + "\n"


def add_config_flags(p: argparse.ArgumentParser, only: tuple[str, ...] | None = None, skip=()) -> None:
    """One flag per :class:`BuildConfig` option (:func:`~thdpack.offline.config.options`: its kind gives
    the flag's type); default None = "not given" (the config's value stays)."""
    g = p.add_argument_group("build options (override the --config file)")
    for option in options():
        if option.name in skip or (only and option.name not in only):
            continue
        flag = "--" + option.name.replace("_", "-")
        kw = dict(default=None, help=_literal_help(option.help), dest=option.name)
        if option.choices:
            kw["choices"] = option.choices
        if option.many:
            kw.update(nargs="+", metavar="PATH")
        if option.kind == "flag":
            g.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        if option.kind == "int":
            kw["type"], kw["metavar"] = integer_at_least(option.minimum), "N"
        elif option.kind == "number":
            kw["type"], kw["metavar"] = float, "X"
        elif option.flag_type is not None:
            kw["type"] = option.flag_type
        g.add_argument(flag, **kw)


def integer_at_least(minimum: int):
    """An argparse ``type``: the argument as an int, refused (a usage error naming the flag) below
    ``minimum`` — the rule :class:`~thdpack.offline.config.Option` checks, applied as the flag is read."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # what argparse names in its messages
    return parse


def _literal_help(text: str | None) -> str | None:
    """``text`` as argparse help: argparse %-formats help strings, so a literal ``%``
    (``{% generation %}`` in the chat_template help) must be doubled."""
    return None if text is None else text.replace("%", "%%")


def build_config(args, *, input_override=None) -> BuildConfig:
    cfg = BuildConfig.from_yaml(args.config) if args.config else BuildConfig()
    changes = {option.name: getattr(args, option.name, None) for option in options()}
    if input_override is not None:
        changes["input"] = input_override
    return cfg.override(**changes)
