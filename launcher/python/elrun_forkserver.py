"""elrun's forkserver (--start-method forkserver): a Python that has already imported torch (and
--preload's modules), from which each (re)started worker is forked instead of exec'd, so a
restart does not pay for `import torch` again.

elrun starts it as `python -u elrun_forkserver.py FD MODULES`, FD one end of a Unix stream socket.
It imports MODULES (comma-separated; one that is not installed is skipped with a note), then
checks that it is safe to fork: no CUDA context (torch initialises CUDA lazily, on first use;
a --preload module that used it is refused here, before any worker exists) and no thread left
after a trial fork (pools that stop themselves at fork, like OpenBLAS's, are gone after it;
a fork would copy any other thread's locks but not the thread). It then answers
{"ready": true} or {"error": "..."}, one JSON line.

Each request is a 4-byte big-endian length and a JSON object, with four file descriptors
(stdin, stdout, stderr, the guardian's pipe) attached to its first bytes:
  {"argv": [...], "env": ["K=V", ...], "cwd": "...", "elrun_pid": N, "reset_signals": [...],
   "cpus": [...], "memory_node": N}
argv is what elrun would have exec'd: [python, -u, SCRIPT, args...], [python, -u, -m, MODULE,
args...] or [python, -u, -c, RUN_PATH_BOOTSTRAP, SCRIPT, args...]. The server forks twice: the
worker's parent exits at once, so the worker is re-parented to elrun (a child subreaper) and is
elrun's own child like an exec'd worker: elrun reaps it, watches it through a pidfd, and kills
its process group. The answer is {"pid": N} once that is so, or {"error": "..."}.

The worker then does what elrun's exec path does before execve: leads its own process group,
dies with elrun (PR_SET_PDEATHSIG, set once elrun is its parent), registers its group with the
guardian, takes the environment, working directory, standard streams, CPU affinity and memory
node of the request, unblocks every signal and resets the forwarded ones, closes every other
file descriptor, and runs the script as `python -u` would (runpy, sys.argv, sys.path[0]).
Standard library only.
"""
import builtins
import ctypes
import gc
import importlib.machinery
import io
import json
import os
import platform
import runpy
import signal
import socket
import struct
import sys
import time
import traceback
import types

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
MPOL_PREFERRED = 1
SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}
MAX_REQUEST = 16 << 20
REPARENT_TIMEOUT_S = 5.0


def _answer(sock, **fields):
    sock.sendall((json.dumps(fields) + "\n").encode())


def _threads():
    return sorted(int(t) for t in os.listdir("/proc/self/task"))


def _thread_names():
    """'name (tid)' of each thread but this one: Python's name for Python threads, else the OS's."""
    python = {}
    threading = sys.modules.get("threading")
    if threading is not None:
        python = {t.native_id: t.name for t in threading.enumerate()}
    names = []
    for tid in _threads():
        if tid == os.getpid():
            continue
        name = python.get(tid)
        if name is None:
            try:
                with open("/proc/self/task/%d/comm" % tid) as f:
                    name = f.read().strip()
            except OSError:
                continue
        names.append("%s (%d)" % (name, tid))
    return names


def _settle_threads():
    """Forks and reaps a child that exits at once: thread pools that stop at fork (OpenBLAS)
    are gone afterwards. Returns the names of the threads still running besides this one."""
    if len(_threads()) == 1:
        return []
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return _thread_names()


def _preload(modules):
    notes = []
    missing = set()
    for name in modules:
        if name.split(".")[0] in missing:
            continue
        try:
            __import__(name)
        except ImportError as error:
            missing.add(name.split(".")[0])
            notes.append("%s not imported (%s)" % (name, error))
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return notes, ("CUDA was initialised in the forkserver while importing %s; a forked worker cannot use "
                       "that context. Do not touch CUDA at import, or run without --start-method forkserver"
                       % ",".join(modules))
    threads = _settle_threads()
    if threads:
        return notes, ("the forkserver runs %d other thread(s) after importing %s: %s; forking would copy their "
                       "locks but not them. Run without --start-method forkserver"
                       % (len(threads), ",".join(modules), ", ".join(threads)))
    return notes, None


def _receive(sock):
    """One request: (dict, [fds]), or None at EOF."""
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 8)
    if not data:
        return None
    while len(data) < 4:
        more = sock.recv(4 - len(data))
        if not more:
            return None
        data += more
    (length,) = struct.unpack(">I", data[:4])
    if length > MAX_REQUEST:
        raise ValueError("request of %d bytes" % length)
    body = bytearray(data[4:])
    while len(body) < length:
        more = sock.recv(min(1 << 20, length - len(body)))
        if not more:
            return None
        body += more
    return json.loads(bytes(body[:length]).decode()), fds


def _spawn(sock, request, fds):
    """Forks the worker (twice). Returns the request in the worker, None in the server."""
    if len(fds) != 4:
        for fd in fds:
            os.close(fd)
        _answer(sock, error="expected 4 file descriptors, got %d" % len(fds))
        return None
    threads = _settle_threads()
    if threads:
        for fd in fds:
            os.close(fd)
        _answer(sock, error="the forkserver runs other threads (%s); run without --start-method forkserver"
                % ", ".join(threads))
        return None
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:  # The middle process: forks the worker and exits at once.
        try:
            os.close(read_end)
            worker = os.fork()
        except BaseException:
            os._exit(1)
        if worker == 0:
            os.close(write_end)
            return request, fds
        try:
            os.write(write_end, struct.pack("i", worker))
        finally:
            os._exit(0)
    os.close(write_end)
    for fd in fds:
        os.close(fd)
    data = os.read(read_end, 4)
    os.close(read_end)
    os.waitpid(middle, 0)  # The worker is elrun's child from here on.
    if len(data) != 4:
        _answer(sock, error="the forked worker did not start (fork failed in the forkserver)")
        return None
    _answer(sock, pid=struct.unpack("i", data)[0])
    return None


def _serve(sock):
    """Serves requests until EOF. Returns (request, fds) in a forked worker; None in the server."""
    while True:
        received = _receive(sock)
        if received is None:
            return None
        request, fds = received
        try:
            job = _spawn(sock, request, fds)
        except Exception as error:  # One bad request must not end the server.
            _answer(sock, error="%s: %s" % (type(error).__name__, error))
            continue
        if job is not None:
            return job


def _become_worker(request, fds):
    """In the forked worker: what elrun's exec path does before execve (see the module doc)."""
    os.setpgid(0, 0)
    elrun = request["elrun_pid"]
    deadline = time.monotonic() + REPARENT_TIMEOUT_S
    while os.getppid() != elrun:  # The middle process exits at once.
        if time.monotonic() > deadline:
            os._exit(127)
        time.sleep(0.0002)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != elrun:  # elrun died before the prctl: the signal will never come.
        os._exit(127)
    stdin, stdout, stderr, guardian = fds
    os.write(guardian, b"+%d\n" % os.getpid())
    if request.get("cpus"):
        os.sched_setaffinity(0, request["cpus"])
    node = request.get("memory_node", -1)
    if node >= 0:
        number = SET_MEMPOLICY.get(platform.machine())
        mask = ctypes.c_ulong(1 << node) if node < 64 else None
        if number is None or mask is None or libc.syscall(number, MPOL_PREFERRED, ctypes.byref(mask), 65) != 0:
            os._exit(127)
    os.dup2(stdin, 0)
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.closerange(3, os.sysconf("SC_OPEN_MAX") if os.sysconf("SC_OPEN_MAX") < (1 << 20) else 1 << 20)
    os.environ.clear()
    for entry in request["env"]:
        key, _, value = entry.partition("=")
        if key:
            os.environ[key] = value
    os.chdir(request["cwd"])
    script = _script_of(request["argv"])
    if script:  # ps shows the server's command line; at least the name is the script's.
        libc.prctl(PR_SET_NAME, os.path.basename(script).encode()[:15], 0, 0, 0)
    encoding = os.environ.get("PYTHONIOENCODING", "utf-8").split(":")[0] or "utf-8"
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=encoding)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=encoding, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding=encoding, errors="backslashreplace",
                                  write_through=True)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    for signo in request.get("reset_signals", []):
        signal.signal(signo, signal.default_int_handler if signo == signal.SIGINT else signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _script_of(argv):
    """The script (or module) argv runs."""
    args = [a for a in argv[1:] if a != "-u"]
    if args[:1] == ["-m"]:
        return args[1] if len(args) > 1 else None
    if args[:1] == ["-c"]:
        args = args[2:]
    return args[0] if args else None


def _run_script(argv):
    """Runs argv (see the module doc) as `python` would; returns the exit code."""
    args = argv[1:]
    while args and args[0] == "-u":
        args = args[1:]
    if args[:1] == ["-m"]:
        sys.argv = [args[1]] + args[2:]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return 0
    if args[:1] == ["-c"]:  # --run-path's bootstrap, as it runs: runpy.run_path of the script.
        sys.argv = args[2:]
        sys.path[0] = ""  # python -c's.
        runpy.run_path(sys.argv[0], run_name="__main__")
        return 0
    script = args[0]
    sys.argv = list(args)
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    if not os.path.isfile(script):  # A directory or zip with a __main__.py.
        runpy.run_path(script, run_name="__main__")
        return 0
    path = os.path.abspath(script)
    with io.open_code(path) as source:
        code = compile(source.read(), path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__cached__ = None
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    exec(code, main.__dict__)
    return 0


def _worker_main(request):
    try:
        if os.environ.get("ELRUN_AUTO_HEARTBEAT") == "1":
            import elrun_autobeat
            elrun_autobeat.install()
        code = _run_script(request["argv"])
    except SystemExit as leaving:
        code = leaving.code
    except BaseException:  # As the interpreter does: the traceback, then exit status 1.
        kind, error, frames = sys.exc_info()
        ours = (__file__, "<frozen runpy>", runpy.__file__)
        while frames is not None and frames.tb_next is not None and frames.tb_frame.f_code.co_filename in ours:
            frames = frames.tb_next  # The script's frames only, as `python script.py` shows them.
        sys.excepthook(kind, error.with_traceback(frames), frames)
        code = 1
    _leave(code)


def _leave(code):
    """Exits as the interpreter does - non-daemon threads joined, atexit handlers run, streams
    flushed, SystemExit's code - but without tearing down every module and object: in a child
    forked from a server holding torch that teardown writes to most of the server's pages (their
    reference counts), copying them, and took ~1 s here."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code & 0xFF
    else:
        sys.stderr.write("%s\n" % (code,))
        status = 1
    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()
        import atexit
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        status = status or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status)


def main():
    server_fd = int(sys.argv[1])
    modules = [m for m in sys.argv[2].split(",") if m] if len(sys.argv) > 2 else []
    sock = socket.socket(fileno=server_fd)
    os.set_inheritable(server_fd, False)
    notes, error = _preload(modules)
    for note in notes:
        sys.stderr.write("[elrun] forkserver: %s\n" % note)
    if error:
        _answer(sock, error=error)
        return 1
    gc.freeze()  # The server's objects: never scanned by the workers' collector (fewer copied pages).
    _answer(sock, ready=True)
    job = _serve(sock)
    if job is None:
        return 0
    request, fds = job
    sock.detach()  # Its descriptor is closed with the others below; the object must not own it.
    try:
        _become_worker(request, fds)
    except BaseException:
        traceback.print_exc()
        os._exit(127)
    return _worker_main(request)


if __name__ == "__main__":
    sys.exit(main())
