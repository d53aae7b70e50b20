"""elrun_heartbeat: progress heartbeats from a training script to elrun, in one line.

    import elrun_heartbeat
    for step, batch in enumerate(loader):
        ...
        elrun_heartbeat.beat(step)

Under `elrun --worker-timeout S` (or --worker-start-timeout), elrun names a FIFO in
ELRUN_HEARTBEAT_FILE; each beat writes one line "<pid> <step> <step_ms> <signal>" to it (an
atomic write under PIPE_BUF). A worker whose beats stop for S seconds is hung: elrun sends it
SIGUSR1, on which this module (installed by the first beat) prints every thread's stack with
faulthandler, then kills it and restarts the group within --max-restarts. Without the variable
(torchrun, or elrun without those options) beat() does nothing. One file, standard library only:
installed with elrun's wheel as `elrun.heartbeat` (`from elrun import heartbeat`), or vendor it,
or put launcher/python on PYTHONPATH.
"""
import faulthandler
import os
import signal
import time

_fd = None
_last = None
_pid = None


def _open():
    global _fd, _pid
    path = os.environ.get("ELRUN_HEARTBEAT_FILE")
    if not path:
        return False
    try:
        _fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    _pid = os.getpid()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # The stacks elrun asks for.
    return True


def beat(step):
    """Reports that step `step` (an int >= 0) finished; the time since the previous beat is sent
    as its duration. Never raises: a heartbeat must not break training."""
    global _last, _fd
    now = time.monotonic()
    if _fd is None or _pid != os.getpid():  # First call, or a forked child.
        _fd = None
        if not _open():
            return
    step_ms = 0.0 if _last is None else (now - _last) * 1000.0
    _last = now
    try:
        os.write(_fd, b"%d %d %.3f %d\n" % (_pid, int(step), step_ms, signal.SIGUSR1))
    except OSError:
        pass  # A full FIFO (elrun busy) drops this beat; the next one counts.
