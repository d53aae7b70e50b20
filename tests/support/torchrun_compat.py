#!/usr/bin/env python3
"""torchrun of the project's torch 2.11 environment: `torchrun_compat.py [torchrun options] script args...`.

With Debian's torch 1.13 this file patched Std.from_str, which broke under Python 3.11; torch 2.11's
torchrun needs no patch, so it now only runs torch.distributed.run unchanged. It stays the one entry
point that the benchmarks and interop tests name for the reference torchrun. Run it with the
environment's interpreter (.venv/bin/python3). It is a reference, not part of elrun.
"""
import sys

from torch.distributed import run

if __name__ == "__main__":
    run.main(sys.argv[1:])
