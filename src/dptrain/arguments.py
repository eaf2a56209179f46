"""Command-line pieces that more than one command needs: a parser whose mistakes are one-line
UserErrors, the `dptrain train` flags (one per TrainConfig field), and KEY=VALUE options.

It sits below cli.py so that `dptrain launch` validates its train arguments exactly as
`dptrain train` would without importing the command line that imports it.
"""

from __future__ import annotations

import argparse
import re
from typing import Any, Iterable, Optional, Sequence

import yaml

from dptrain.config import FIELDS, SECTIONS, TrainConfig, choices_of, flag_of, parse_yaml, resolve, section_of
from dptrain.errors import UserError, did_you_mean


class Parser(argparse.ArgumentParser):
    """argparse that reports mistakes as UserError (one line, exit 2)."""

    def error(self, message: str):
        if message.startswith("argument COMMAND: invalid choice:"):  # a mistyped command: name the closest
            word = message.split("'")[1]
            commands = next(a for a in self._actions if isinstance(a, argparse._SubParsersAction)).choices
            hint = did_you_mean(word, list(commands)) or f"commands are: {', '.join(commands)}"
            raise UserError(f"unknown command '{word}'; {hint}")
        # argparse's "argument --epochs: expected one argument" in our voice; UserError adds 'dptrain: error:'.
        if message.startswith("argument "):
            name, _, problem = message.removeprefix("argument ").partition(": ")
            choice = re.fullmatch(r"invalid choice: (.*) \(choose from (.*)\)", problem)
            if problem == "expected one argument":
                problem = "needs a value"
            elif choice:
                problem = f"must be one of {choice[2].replace(chr(39), '')} (got {choice[1]})"
            message = f"{name.split('/')[0]} {problem}"
        required = re.fullmatch(r"the following arguments are required: (.*)", message)
        if required:
            message = f"{required[1]} {'are' if ',' in required[1] else 'is'} required"
        where = "" if self.prog == "dptrain" else f" (see '{self.prog} --help')"
        raise UserError(f"{message}{where}")

    def reject_unknown(self, unknown: list[str]):
        """One line for the first unknown option, with the flag this command has that was meant."""
        first = next((word for word in unknown if word.startswith("-")), unknown[0])
        if not first.startswith("-"):
            raise UserError(f"unexpected word '{first}' for '{self.prog}'; its settings are --options, "
                            f"see '{self.prog} --help'")
        flags = [opt for action in self._actions for opt in action.option_strings if opt.startswith("--")]
        hint = did_you_mean(first.split("=")[0], flags) or f"see '{self.prog} --help'"
        raise UserError(f"unknown option {first} for '{self.prog}'; {hint}")


# What each section's flags are, under its name in --help (dptrain.config.SECTIONS).
SECTION_HELP = {"data": "what to train on and how it is read", "model": "what to train and its loss",
                "optimizer": "each worker's steps and learning rate",
                "strategy": "how workers synchronise, and the options of each strategy (its page under How-to guides)",
                "sharding": "how each replica is held: whole, or sharded over a replica group's ranks",
                "run": "length, precision, checkpoints, outputs",
                "membership": "the workers, and what happens when one fails or joins"}


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, listed in --help by section; values stay strings/None so the config
    validates them once."""
    parser.add_argument("--config", metavar="FILE", help="YAML file with the same keys as the flags (flags win)")
    groups = {name: parser.add_argument_group(name, SECTION_HELP.get(name)) for name in SECTIONS}
    for name, field in FIELDS.items():
        group = groups[section_of(name)]
        default = field.default if field.default_factory is None else field.default_factory()
        choices = choices_of(name)  # listed by the metavar: --amp {none,bf16,fp16}
        help_text = field.description.replace("%", "%%")  # argparse formats help with %
        if default not in (None, {}):  # an unset default is described in the text, if at all
            help_text += f" (default: {str(default).lower() if isinstance(default, bool) else default})"
        if name == "model_options":
            group.add_argument("--model-option", dest=name, action="append", metavar="KEY=VALUE", help=help_text)
        elif field.annotation is bool:
            group.add_argument(flag_of(name), dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        else:
            metavar = "{" + ",".join(choices) + "}" if choices else name.upper()
            group.add_argument(flag_of(name), dest=name, metavar=metavar, default=None, help=help_text)


def parse_key_values(items: Iterable[str], *, flag: str, example: str,
                     keys: Optional[Iterable[str]] = None) -> dict[str, Any]:
    """`KEY=VALUE` words as {KEY: VALUE read as YAML}. With `keys`, only those keys are allowed ('-' reads as '_')."""
    allowed = None if keys is None else list(keys)
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if allowed is not None:
            key = key.replace("-", "_")
        if not sep or not key:
            raise UserError(f"{flag} {item!r} is not KEY=VALUE, e.g. {flag} {example}")
        if allowed is not None and key not in allowed:
            hint = did_you_mean(key, allowed) or f"valid keys are: {', '.join(allowed)}"
            raise UserError(f"{flag} {item!r} has unknown key '{key}'; {hint}")
        try:
            options[key] = parse_yaml(value)
        except yaml.YAMLError:
            raise UserError(f"{flag} {item!r}: the value {value!r} is not valid YAML, e.g. {flag} {example}") from None
    return options


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of parsed `dptrain train` arguments (file, then flags), validated once."""
    overrides = {name: getattr(args, name) for name in FIELDS}
    # None, not {}, without the flag: an empty mapping would replace the config file's model_options.
    overrides["model_options"] = (parse_key_values(args.model_options, flag="--model-option", example="depth=14")
                                  if args.model_options else None)
    return resolve(args.config, overrides)


def train_config(train_args: Sequence[str]) -> TrainConfig:
    """Validate `dptrain train` arguments exactly as that command does; returns the TrainConfig."""
    parser = Parser(prog="dptrain train", allow_abbrev=False)
    add_config_flags(parser)
    args, unknown = parser.parse_known_args(list(train_args))
    if unknown:
        parser.reject_unknown(unknown)
    return config_from_args(args)
