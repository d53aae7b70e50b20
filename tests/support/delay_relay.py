"""A TCP relay that delays every byte it forwards: the link delay and jitter that tc netem would
give, for kernels without sch_netem (netlab.py). Run inside a test host's namespace:

  delay_relay.py --listen ADDR:0 --target HOST:PORT --delay-ms 200 --jitter-ms 100

Each accepted connection gets its own connection to the target; in each direction a chunk read at
time t is written at max(t + delay +- jitter, the previous chunk's time), so the stream's order is
kept (as netem's delay without reordering). Prints "delay_relay listening on ADDR:PORT". Runs
until killed; a connection ends when either side closes it.
"""
import argparse
import random
import socket
import threading
import time
from collections import deque


def pipe(src, dst, delay_s, jitter_s, rng):
    queue, cond, state = deque(), threading.Condition(), {"eof": False}

    def writer():
        while True:
            with cond:
                while not queue and not state["eof"]:
                    cond.wait()
                if not queue:
                    break
                due, data = queue.popleft()
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)  # The delay being emulated, not a synchronisation.
            try:
                dst.sendall(data)
            except OSError:
                break
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    last = 0.0
    while True:
        try:
            data = src.recv(65536)
        except OSError:
            data = b""
        with cond:
            if not data:
                state["eof"] = True
                cond.notify()
                break
            last = max(last, time.monotonic() + max(0.0, delay_s + rng.uniform(-jitter_s, jitter_s)))
            queue.append((last, data))
            cond.notify()
    thread.join()


def serve(conn, target, delay_s, jitter_s, seed):
    try:
        upstream = socket.create_connection(target, timeout=10)
        upstream.settimeout(None)
    except OSError:
        conn.close()
        return
    for sock in (conn, upstream):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rng = random.Random(seed)
    threads = [threading.Thread(target=pipe, args=(conn, upstream, delay_s, jitter_s, rng), daemon=True),
               threading.Thread(target=pipe, args=(upstream, conn, delay_s, jitter_s, rng), daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    conn.close()
    upstream.close()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--delay-ms", type=float, default=0)
    parser.add_argument("--jitter-ms", type=float, default=0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    thost, _, tport = args.target.rpartition(":")
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((host, int(port)))
    server.listen(64)
    print("delay_relay listening on %s:%d" % (host, server.getsockname()[1]), flush=True)
    n = 0
    while True:
        conn, _ = server.accept()
        n += 1
        threading.Thread(target=serve, args=(conn, (thost, int(tport)), args.delay_ms / 1000.0,
                                             args.jitter_ms / 1000.0, args.seed + n), daemon=True).start()


if __name__ == "__main__":
    main()
