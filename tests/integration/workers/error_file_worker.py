"""Worker: fails the way a torchrun worker decorated with @record does, without importing torch.

On TORCHELASTIC_RESTART_COUNT < FAIL_UNTIL_RESTART (default 1) and LOCAL_RANK in FAIL_RANKS
(default "0"), writes TORCHELASTIC_ERROR_FILE in torchrun's format with the message
"ValueError: boom" and exits 1; otherwise exits 0.
"""
import json
import os
import sys
import time


def main():
    fail_ranks = os.environ.get("FAIL_RANKS", "0").split(",")
    fail_until = int(os.environ.get("FAIL_UNTIL_RESTART", "1"))
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if os.environ["LOCAL_RANK"] not in fail_ranks or restart >= fail_until:
        return 0
    error = {"message": {"message": "ValueError: boom",
                         "extraInfo": {"py_callstack": "Traceback (most recent call last):\n"
                                                       "  File \"error_file_worker.py\"\n"
                                                       "ValueError: boom\n",
                                       "timestamp": str(int(time.time()))}}}
    path = os.environ["TORCHELASTIC_ERROR_FILE"]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(error, f)
    print("error_file_worker: failing on purpose", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
