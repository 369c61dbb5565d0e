"""Worker scripts die with the test process that started them.

A pytest run that is killed (a timeout, ^C twice, a stopped session) does not run
its cleanup, and the multi-process workers it started would go on burning CPU (one
ran for 95 minutes). Importing this module (first thing in a worker) asks Linux to SIGKILL the
process when its parent exits (PR_SET_PDEATHSIG); elsewhere it does nothing.
"""

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request was made
        os._exit(1)


die_with_parent()
