"""The base of every user-facing error: main.py prints its one-line message and exits 1
(with no traceback unless --debug), so a mistake reads as what to fix. And the signals that
stop a run outside its training loop (Ctrl-C, SIGTERM), as exceptions every layer can
recognise, however a library wrapped them."""


class UserError(ValueError):
    """A config, file or data problem the user can fix; the message names it."""


class Terminated(BaseException):
    """SIGTERM outside a training loop, on one process (training/preemption.py): raised
    in the main thread as a Ctrl-C's KeyboardInterrupt is, so that what is being written
    is cleaned up on the way out (a preparation's shards, packing's scratch, an export's
    temporary directory) and main.py ends with one line and status 143. A BaseException,
    as KeyboardInterrupt: an `except Exception` must not take it for a failure."""


def interrupted(error: BaseException | None) -> BaseException | None:
    """The KeyboardInterrupt or Terminated that `error` is, or was raised while handling
    (a library that wraps what interrupted it: numpy, Beam), or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt | Terminated):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None
