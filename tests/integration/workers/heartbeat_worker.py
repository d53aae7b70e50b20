"""Worker: progress heartbeats through launcher/python/elrun_heartbeat.py. Modes:
`hang-first`: beats 3 steps, then on attempt 0 hangs in a busy loop (alive, no progress); later
attempts beat 3 steps and exit 0. `steady`: beats 20 steps 50 ms apart, exits 0. `silent S`: never
beats, sleeps S seconds, exits 0. `pace`: beats for ~4.8 s, steps of 30 ms (120 ms on local rank 2).
`pace-rank R S`: beats for S seconds, steps of 30 ms (120 ms on global rank R). `junk PID`: writes
malformed lines and a beat naming PID (not a worker), then beats 3 steps and exits 0."""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "launcher",
                                "python"))
import elrun_heartbeat  # noqa: E402


def main():
    mode = sys.argv[1]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if mode == "silent":
        print("silent pid %d" % os.getpid(), flush=True)
        time.sleep(float(sys.argv[2]))
        print("silent done", flush=True)
        return
    if mode == "junk":
        fd = os.open(os.environ["ELRUN_HEARTBEAT_FILE"], os.O_WRONLY)
        os.write(fd, b"not a beat\n" + b"x" * 300 + b"\n" + b"%s 1 2.0\n" % sys.argv[2].encode())
        os.close(fd)
    steps = {"steady": 20}.get(mode, 3)
    pause = 0.05
    if mode == "pace":
        pause = 0.12 if os.environ["LOCAL_RANK"] == "2" else 0.03
        steps = int(4.8 / pause)
    if mode == "pace-rank":
        pause = 0.12 if os.environ["RANK"] == sys.argv[2] else 0.03
        steps = int(float(sys.argv[3]) / pause)
    for step in range(steps):
        time.sleep(pause)
        elrun_heartbeat.beat(step)
    if mode == "hang-first" and attempt == 0:
        print("hanging after step 2 pid %d" % os.getpid(), flush=True)
        while True:  # Alive and busy, no progress.
            pass
    print("attempt %d done" % attempt, flush=True)


if __name__ == "__main__":
    main()
