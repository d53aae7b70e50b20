#!/usr/bin/python3
"""Debian's torchrun (torch 1.13.1) under Python 3.11, made to start.

torch 1.13's Std.from_str looks a value up by iterating the IntFlag Std, and Python 3.11 no longer
yields the zero member (Std.NONE) when iterating, so torchrun dies at start-up in Std.from_str for
the default "--redirects 0". This wrapper replaces that one function with a direct lookup and then
runs torchrun unchanged: `torchrun_compat.py [torchrun options] script args...`.
It is a reference for benchmarks and interop tests, not part of elrun.
"""
import re
import sys

from torch.distributed.elastic.multiprocessing import api
from torch.distributed import run


def _from_str(cls, vm):
    if re.match(api._VALUE_REGEX, vm):
        return cls(int(vm))
    if re.match(api._MAPPING_REGEX, vm):
        return {int(i): cls(int(v)) for i, v in (m.split(":") for m in vm.split(","))}
    raise ValueError(f"{vm} does not match: <{api._VALUE_REGEX}> or <{api._MAPPING_REGEX}>")


api.Std.from_str = classmethod(_from_str)

if __name__ == "__main__":
    run.main(sys.argv[1:])
