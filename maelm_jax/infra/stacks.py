"""Every thread's Python stack on demand: `kill -USR1 <pid>` makes a process print them
(Python's faulthandler), whatever it is doing, a collective that never returns included,
which is how a hung pod is read (docs/scaling.md#a-hung-run).

faulthandler writes from its C signal handler to one file descriptor, without the
interpreter (whose main thread may be stuck inside XLA): to stderr alone (`on_signal()`,
every process of main.py from its start), or, once a run writes its workdir, to stderr and
<workdir>/stacks/process_<i>.txt together (`on_signal(directory)`): the descriptor is then
a pipe into `tee`, a process of its own that needs no interpreter either.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import subprocess
import sys

from maelm_jax.infra import paths

SIGNAL = signal.SIGUSR1
_held: list = []  # the tee process and the pipe's write end of the registration in force


def file_name(process: int) -> str:
    return f"process_{process}.txt"


def on_signal(directory: paths.Path | None = None, process: int = 0) -> paths.Path | None:
    """Registers SIGUSR1 to dump every thread's stack to stderr and, given a local
    `directory`, appended to directory/process_<process>.txt as well. Returns that file,
    or None (stderr alone: no directory, one in a bucket, or no `tee` on this system)."""
    target = None
    if directory is not None and paths.is_local(directory) and shutil.which("tee"):
        paths.make_dirs(directory)
        target = directory / file_name(process)
    if target is None:
        faulthandler.register(SIGNAL, file=sys.__stderr__, all_threads=True, chain=False)
        _release()
        return None
    read_end, write_end = os.pipe()
    tee = subprocess.Popen(["tee", "-a", str(target)], stdin=read_end,
                           stdout=sys.__stderr__.fileno(), close_fds=True,
                           start_new_session=True)  # a Ctrl-C to the job is not its business
    os.close(read_end)
    faulthandler.register(SIGNAL, file=write_end, all_threads=True, chain=False)
    _release()
    _held.extend((tee, write_end))
    return target


def _release() -> None:
    """Lets go of an earlier registration's pipe: closing its write end ends its tee."""
    while _held:
        item = _held.pop()
        if isinstance(item, int):
            os.close(item)


def describe(target: paths.Path | None) -> str:
    where = f"stderr and {target}" if target else "stderr"
    return f"kill -USR1 {os.getpid()} prints every thread's stack to {where}"
