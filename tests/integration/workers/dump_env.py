"""Worker: records what it was started with, then exits 0.

Writes <out_dir>/env_r<RANK>_a<TORCHELASTIC_RESTART_COUNT>.json (atomically: write, then rename)
with its environment, argv, pid, interpreter and whether stdout is unbuffered (python -u).
Usage: dump_env.py OUT_DIR [args...]; RANK/TORCHELASTIC_RESTART_COUNT default to "x" when unset.
"""
import json
import os
import sys


def main():
    out_dir = sys.argv[1]
    name = "env_r%s_a%s.json" % (os.environ.get("RANK", "x"),
                                 os.environ.get("TORCHELASTIC_RESTART_COUNT", "x"))
    record = {
        "env": dict(os.environ),
        "argv": sys.argv,
        "pid": os.getpid(),
        "executable": sys.executable,
        "stdout_write_through": getattr(sys.stdout, "write_through", None),
    }
    tmp = os.path.join(out_dir, name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.rename(tmp, os.path.join(out_dir, name))


if __name__ == "__main__":
    main()
