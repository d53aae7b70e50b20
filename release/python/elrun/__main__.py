"""`python -m elrun ARGS`: runs the installed `elrun ARGS` in this process's place."""
import os
import sys

from elrun import program

if __name__ == "__main__":
    os.execv(program("elrun"), ["elrun"] + sys.argv[1:])
