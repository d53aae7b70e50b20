"""A worker whose main is decorated with torch.distributed.elastic's @record, and rank 1 raises.

Usage: record_error.py (under elrun or torchrun, --nproc-per-node 2). Both ranks join a Gloo
process group; each prints `ERROR_FILE <rank> <path>` (TORCHELASTIC_ERROR_FILE, where @record
writes the exception). Rank 0 then leaves cleanly (exit 0); rank 1 raises a ValueError, which
@record writes to its error file (message, traceback, timestamp) before the interpreter exits 1.
The launcher must report the job failed and name the exception.
"""
import os

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import job_common

MESSAGE = "deliberate failure in rank 1 of the record_error job"


def fail():
    raise ValueError(MESSAGE)


@record
def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    job_common.say("ERROR_FILE %d %s" % (rank, os.environ.get("TORCHELASTIC_ERROR_FILE")))
    dist.barrier()  # Both have printed before rank 1 fails.
    dist.destroy_process_group()
    if rank == 1:
        fail()


if __name__ == "__main__":
    main()
