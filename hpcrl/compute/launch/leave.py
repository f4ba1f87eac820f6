"""How a launch task leaves: having failed, at once; having finished its collectives, not through
the interpreter's finalization.

A failed task skips MPI_Finalize, which may wait on peers that are gone. A finished one skips
Python's finalization: a gloo group's worker thread may still be dropping its last collective's
work after the caller saw it complete (a barrier keeps the collectives before it, and their
tensors, until its worker lets go); freeing a tensor that has a Python object needs the GIL, and a
thread that asks for the GIL once Python is finalizing is ended by pthread_exit, whose unwinding
through a noexcept C++ destructor aborts the whole process: "terminate called without an active
exception", SIGABRT, after the model had been written. Two FSDP2 gloo ranks that train a step,
barrier, destroy their group and return aborted in 12 of 60 runs here; ending through
`exit_finished` instead, 0 of 40 (see tests/compute/launch/test_launch_exit.py for the parts that a test can
check every time).
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def exit_finished(code: int = 0) -> NoReturn:
    """Do what finalization does that matters, in its order, then the C library's exit(code):
    other threads joined and atexit handlers run (the interpreter's own two steps, hence the
    private names), the standard streams flushed, MPI finalized (mpi4py does that from
    Py_AtExit, which only finalization runs; a rank without MPI_Finalize strands MPICH's
    shared-memory segments). exit(), not os._exit: MPICH tells the launcher's PMI server that
    the rank finalized from a C atexit handler, and hydra SIGKILLs every rank still running when
    one leaves without saying so (a finished job then ends "Killed (signal 9)")."""
    import atexit
    import ctypes
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    ctypes.PyDLL(None).exit(code)   # PyDLL: holding the GIL, which C++ static destructors of torch need
    os._exit(code)                  # not reached


def exit_failed(code: int) -> int:
    """A failed task skips MPI_Finalize, which may wait on peers that are gone."""
    if "mpi4py.MPI" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
