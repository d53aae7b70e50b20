"""Worker: torch's own FileTimerClient against TORCHELASTIC_TIMER_FILE, as torchrun scripts use
it. Argument `hang-first`: on attempt 0 the scope "train_step" (1 s) never ends, so the
watchdog must reap the worker; later attempts finish the scope in time and exit 0. Argument
`name-pid PID`: acquires an expired timer for another process's pid (what any writer of the
FIFO can send), then finishes its own scope and exits 0."""
import os
import sys
import threading
import time

from torch.distributed.elastic import timer
from torch.distributed.elastic.timer import FileTimerClient, FileTimerRequest


def main():
    path = os.environ["TORCHELASTIC_TIMER_FILE"]
    timer.configure(FileTimerClient(path))
    mode = sys.argv[1]
    if mode == "name-pid":
        other = int(sys.argv[2])
        client = FileTimerClient(path)
        client._send_request(FileTimerRequest(other, "not_mine", time.time() - 1, 9))
        with timer.expires(after=30, scope="own_step"):
            pass
        print("named pid %d" % other, flush=True)
        return
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    with timer.expires(after=1, scope="train_step"):
        if attempt == 0:
            print("hanging in train_step pid %d" % os.getpid(), flush=True)
            threading.Event().wait()  # A hung step: only the watchdog ends it.
    print("attempt %d done" % attempt, flush=True)


if __name__ == "__main__":
    main()
