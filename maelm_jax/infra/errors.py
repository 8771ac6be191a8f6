"""The base of every user-facing error: main.py prints its one-line message and exits 1
(with no traceback unless --debug), so a mistake reads as what to fix."""


class UserError(ValueError):
    """A config, file or data problem the user can fix; the message names it."""
