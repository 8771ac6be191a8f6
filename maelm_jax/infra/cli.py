"""Command lines: --config with --config.<field>=<value> overrides, and every mistake in
them as one line on stderr and exit status 1.

main.py, scripts/ and benchmarks/ all define their --config with `define_config` and parse
with `parse_flags`, so a mistyped field, a bad value, a missing or failing config file, or
a stray argument reads the same everywhere (`--debug` on the command line shows the
traceback instead).
"""

from __future__ import annotations

import os
import re
import sys
from typing import NoReturn

from absl import flags
from ml_collections import config_flags


def fail(message: str, prefix: str = "error") -> NoReturn:
    """Exits with status 1 after one line on stderr: `<prefix>: <message>`."""
    print(f"{prefix}: {message}", file=sys.stderr)
    sys.exit(1)


def program() -> str:
    """The running script's file name, the prefix of the tools' error lines."""
    return os.path.basename(sys.argv[0])


def one_line(error: BaseException) -> str:
    """An error's message alone, on one line: config_flags wraps a config file's own error
    in its traceback, and ConfigDict reports an unknown field as the repr of a key."""
    text = str(error).strip()
    if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":  # a quoted repr
        text = text[1:-1]
    text = text.replace("\\n", "\n").replace("\\'", "'")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if isinstance(error, OSError) and "failure to load: " in text:  # an unreadable file
        return "--config: " + lines[-1].split("failure to load: ")[-1]
    if "Traceback (most recent call last):" in text:
        # The last line is "<module>.<ExceptionClass>: message"; keep the message.
        message = re.sub(r"^[\w.]+(Error|Exception): ", "", lines[-1])
        return f"{lines[0].split(':')[0]}: {message}"
    return " ".join(lines)


def _config_file_error(argv: list[str]) -> str | None:
    """A --config naming no file: config_flags would defer the error to a traceback."""
    values = [arg.split("=", 1)[1] for arg in argv[1:] if arg.startswith("--config=")]
    values += [argv[i + 1] for i, arg in enumerate(argv[1:-1], start=1) if arg == "--config"]
    if not values:
        return None
    path = values[-1].split(":", 1)[0]
    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "does not exist"
        return (f"--config: {path} {what} (relative to {os.getcwd()}); expected a config file "
                "such as configs/pretrain/quickstart.py")
    return None


def _unknown_field(argv: list[str], error: BaseException) -> str | None:
    """An override of a field (--config.model.dropuot) or through a section
    (--config.modle.dropout, a new source --config.data.sources.extra.kind) that the
    config does not have: ml_collections names only the key."""
    # KeyError / AttributeError (or absl's wrapping of them): "'key'" and maybe a hint.
    text = str(error).strip()
    if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":  # a quoted repr
        text = text[1:-1]
    text = text.replace("\\n", " ").replace("\\'", "'").replace('\\"', '"')
    quoted = re.match(r"""'([^']+)'(?:\s*Did you mean "([^"]+)")?""", text)
    bare = isinstance(error, KeyError) and re.fullmatch(r"([\w-]+)()", text)
    match = quoted or bare
    if not match:
        return None
    key, suggestion = match.groups()
    for arg in argv[1:]:
        name = arg.split("=", 1)[0]
        parts = name.removeprefix("--config.").split(".")
        if arg.startswith("--config.") and key in parts:
            prefix = ".".join(["config", *parts[: parts.index(key)]])
            if key in parts[:-1]:
                hint = (f"; did you mean {prefix}.{suggestion}?" if suggestion else
                        "; a new section (such as another source) needs a config file")
            else:
                hint = f"; did you mean {prefix}.{suggestion}?" if suggestion else ""
            return f"{name}: {prefix} has no field {key!r}{hint}"
    return None


def _message(argv: list[str], error: BaseException) -> str:
    return _unknown_field(argv, error) or one_line(error)


def define_config(default: str | None, help_text: str, prefix: str = "error",
                  **kwargs) -> None:
    """Defines --config (file.py[:variant]). With a default, config_flags loads the default
    file (and applies the command line's overrides) right here; their errors are one line."""
    try:
        config_flags.DEFINE_config_file("config", default, help_text, **kwargs)
    except Exception as e:  # noqa: BLE001 - whatever the config file or an override raised
        if "--debug" in sys.argv:
            raise
        fail(_message(sys.argv, e), prefix)


def parse_flags(argv: list[str], prefix: str = "error") -> list[str]:
    """absl.app.run's flags_parser: flag and config-override mistakes exit 1 with one line
    `<prefix>: <message>`; so do stray arguments. Returns argv's unparsed remainder."""
    debug = "--debug" in argv
    message = None if debug else _config_file_error(argv)
    if message is None:
        try:
            rest = flags.FLAGS(argv)
            if "config" in flags.FLAGS and not isinstance(flags.FLAGS.config, str | None):
                flags.FLAGS.config.keys()  # a file that failed to load raises when first read
        except Exception as e:  # noqa: BLE001 - config_flags raises whatever the file did
            if debug:
                raise
            message = _message(argv, e)
        else:
            if len(rest) > 1:
                message = f"unexpected arguments: {' '.join(rest[1:])}"
            else:
                return rest
    fail(message, prefix)


def _local(value: str) -> bool:
    return bool(value) and "://" not in value  # a bucket's path is checked where it is used


def directory_flag(name: str) -> None:
    """Checks, while parsing, that --`name` (if given) is a directory or does not exist yet:
    one line naming the flag, not a failed write once the work is done."""
    flags.register_validator(
        name, lambda v: not _local(v) or not os.path.exists(v) or os.path.isdir(v),
        message=f"--{name}: expected a directory (new or existing), got a file")


def output_file_flag(name: str) -> None:
    """Checks, while parsing, that --`name` (if given) can be a file: not a directory, in
    a directory that exists."""
    flags.register_validator(
        name, lambda v: not _local(v) or (not os.path.isdir(v)
                                          and os.path.isdir(os.path.dirname(os.path.abspath(v)))),
        message=f"--{name}: expected a file to write, in a directory that exists")


def input_file_flag(name: str) -> None:
    """Checks, while parsing, that --`name` (if given) is a file that exists."""
    flags.register_validator(name, lambda v: not _local(v) or os.path.isfile(v),
                             message=f"--{name}: expected a file that exists")


def choices_flag(name: str, choices, also: tuple[str, ...] = ()) -> None:
    """Checks, while parsing, that every item of the list flag --`name` is one of `choices`
    (or of `also`, words with a meaning of their own such as 'all'): one line naming the
    flag, the unknown items and the choices, before any work."""
    known = [*also, *choices]

    def check(items) -> bool:
        items = items.split(",") if isinstance(items, str) else (items or [])
        unknown = [i for i in (x.strip() for x in items) if i and i not in known]
        if unknown:
            raise flags.ValidationError(f"unknown {', '.join(unknown)}; expected "
                                        f"some of {', '.join(known)}")
        return True

    flags.register_validator(name, check)


def tool_flags_parser(argv: list[str]) -> list[str]:
    """parse_flags for scripts and benchmarks: their error lines start with their name."""
    return parse_flags(argv, program())


def forwarding_flags_parser(argv: list[str]) -> list[str]:
    """The flags parser of a script that hands what follows `--` to main.py (which checks
    it): the script's own flag mistakes are one line starting with its name; the rest is
    returned as it is."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(_message(argv, e), program())
