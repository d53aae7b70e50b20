"""What the jobs of this folder share: rank 0's RESULT line, and leaving without torch's teardown."""
import json
import os
import sys


def say(line):
    """Prints line in one write: under torchrun and elrun alike the ranks share one stdout, where
    print() under -u (both launchers run python3 -u) makes two writes, the text and its newline,
    and another rank's output could come between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def report(record):
    """Prints rank 0's `RESULT {json of record}`, the line the tests read."""
    say("RESULT " + json.dumps(record))


def leave():
    """Exits 0 at once, without torch's teardown: everything the job writes is written by now, and
    torch 2.11 sometimes ends a Gloo process group badly. Destroyed while one of its threads frees a
    finished collective (a tensor whose last reference that thread holds), its destructor, holding
    the GIL, joins that thread, which waits for the GIL: a hang (seen under both launchers, after
    DDP's Reducer let go of the group). Left to the interpreter's exit, a worker sometimes aborts
    with "terminate called without an active exception" (seen with MASTER_ADDR=localhost, which
    torchrun --standalone sets)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
