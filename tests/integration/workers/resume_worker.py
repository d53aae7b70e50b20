"""Worker: a job that checkpoints and resumes, with progress heartbeats. `resume_worker.py DIR
STEPS EVERY PAUSE`: steps 0..STEPS-1, PAUSE seconds each, a beat after each; local rank 0 writes
DIR/ckpt (the next step to run) every EVERY steps, atomically; every worker starts from it. Exits 0
after the last step."""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "launcher",
                                "python"))
import elrun_heartbeat  # noqa: E402


def main():
    directory, steps, every, pause = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    ckpt = os.path.join(directory, "ckpt")
    start = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
    print("rank %s starts at step %d pid %d" % (os.environ["RANK"], start, os.getpid()), flush=True)
    for step in range(start, steps):
        time.sleep(pause)
        elrun_heartbeat.beat(step)
        if os.environ["LOCAL_RANK"] == "0" and (step + 1) % every == 0:
            with open(ckpt + ".tmp", "w") as out:
                out.write(str(step + 1))
            os.replace(ckpt + ".tmp", ckpt)


if __name__ == "__main__":
    main()
