"""
The tests' launcher. `python tests/spawn.py N script.py [args...]` stands in for
`torchrun --standalone --nproc_per_node=N`: it starts N copies of the script with the environment
torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), and when one exits non-zero it stops the others (SIGTERM, then SIGKILL after a grace
period) and exits with that code, as torchrun does. Tests of what torchrun adds (restarts,
rendezvous across nodes, its failure report) launch torchrun itself.

The tests do not pay an interpreter's start for each process, though. Importing torch takes 2-3 s
on the CI machine, and the suite starts hundreds of processes. So each pytest worker keeps a fork
server (`Server`): one process that has imported torch and the libraries the scripts use, and forks
a child for each command instead of exec'ing Python. A child runs the command as Python would: its
own argv, environment, working directory, stdio, `__main__` and exit code. Only what Python decides
once at start-up is the server's: PYTHONHASHSEED, the interpreter's flags, and the modules already
imported (torch reads a few environment variables as it imports; the tests vary none of them).

    server process (imported torch)
      └─ a run: a session of its own, as `python ARGV` or as this launcher for N ranks
           └─ rank 0 .. N-1

The server reaps each run and sends its exit status to the test, whose `Run` stands in for the
subprocess.Popen it would otherwise hold. torchrun, started as such a run, starts its workers
through the server too: PYTHON_EXEC (torchrun's own setting) names a small client, `client()`,
which the server forks the worker for. The server never initializes CUDA, so a forked run may.
"""
import fcntl
import json
import os
import random
import select
import selectors
import signal
import socket
import subprocess
import sys
import time
import traceback
import types

GRACE_S = 30
server_sigterm = None  # the server's SIGTERM handler, which a run puts back to the default
# what the scripts under test import at their top: loaded once in the server, not in every run
PRELOAD = ("numpy", "torch", "torch.distributed", "torch.distributed.checkpoint",
           "torch.distributed.checkpoint.state_dict", "torch.distributed.fsdp", "torch.distributed.tensor",
           "torch.nn.functional", "torch.utils.checkpoint", "torch.optim")


def free_port():
    """A free port from this pytest-xdist worker's own block, below the kernel's ephemeral range
    (32768 and up), which sockets bound to port 0 draw from: a port found by binding port 0 could be
    handed to another test's listener before the rank that is to serve on it binds it."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    block = range(20000 + 1000 * worker, 21000 + 1000 * worker)
    for port in random.sample(block, len(block)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {block.start}..{block.stop - 1}")


# ---- one run: the launcher and the program ------------------------------------------------
def run_ranks(nproc, start_rank):
    """Start `nproc` ranks with torchrun's worker environment (start_rank(env) starts one and returns
    its pid), wait until all succeed or one fails, stop the rest, and return the exit code."""
    base = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc))
    running = {start_rank(dict(base, RANK=str(r), LOCAL_RANK=str(r))) for r in range(nproc)}
    # our own SIGTERM (a test tearing the launcher down) goes on to the ranks
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(stop(running, 143)))
    while running:
        pid, status = os.wait()  # (any rank: the first to fail need not be rank 0)
        running.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if code:
            return stop(running, code)
    return 0


def stop(running, code):
    """SIGTERM what still runs, SIGKILL it after GRACE_S; returns `code` as an exit code (a rank
    killed by a signal reads as 128 + it)."""
    for pid in running:
        os.kill(pid, signal.SIGTERM)
    deadline = time.time() + GRACE_S
    while running and time.time() < deadline:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid:
            running.discard(pid)
        else:
            time.sleep(0.02)
    for pid in running:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return 128 - code if code < 0 else code


def run_program(argv):
    """Run `python ARGV` (a script, -c CODE or -m MODULE) in this process as Python's main would,
    and return its exit code."""
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    try:
        if argv[0] == "-m":
            import runpy
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, os.getcwd())
            runpy._run_module_as_main(argv[1])  # (what `python -m` calls)
        else:
            if argv[0] == "-c":
                path, source, sys.argv = "<string>", argv[1], ["-c", *argv[2:]]
                sys.path.insert(0, "")
            else:
                path, sys.argv = os.path.abspath(argv[0]), list(argv)
                with open(path, "rb") as f:
                    source = f.read()
                sys.path.insert(0, os.path.dirname(path))
                main.__file__ = path
            main.__builtins__ = __builtins__
            exec(compile(source, path, "exec"), main.__dict__)
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def leave(code):
    """Exit as Python does after its main module (non-daemon threads joined, atexit handlers run,
    stdio flushed), but without tearing down every module: with torch loaded that takes a second."""
    import atexit
    import threading
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def become(request, fds):
    """In a forked child: take the request's environment, directory and file descriptors."""
    if signal.getsignal(signal.SIGTERM) is server_sigterm:  # (not if coverage.py took it after the fork)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = extra  # (read at start-up by Python: here, at the run's start)
    os.chdir(request["cwd"])
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for fd in fds]  # (out of the way of the targets)
    for fd in fds:
        os.close(fd)
    for target, fd in zip(request["fds"], high):
        os.dup2(fd, target)
        os.close(fd)


def child_main(request):
    """A run, in the child the server forked: its own session, then the program or N ranks."""
    os.setsid()  # (so that a test's killpg reaches the run and its ranks, and nothing else)
    if request["nproc"] is None:
        return run_program(request["argv"])

    def start_rank(env):
        pid = os.fork()
        if pid == 0:
            os.environ.update(env)
            leave(run_program(request["argv"]))
        return pid
    return run_ranks(request["nproc"], start_rank)


# ---- the server -----------------------------------------------------------------------------
def serve(path):
    """Accept runs on unix socket `path` until SIGTERM or until the parent exits; returns the
    request in a forked child (which runs it), never in the server."""
    for name in PRELOAD:
        __import__(name)
    parent, server = os.getppid(), os.getpid()
    runs = {}  # pid -> the connection its exit status goes to

    def shut_down(*_):
        if os.getpid() != server:  # a run's SIGTERM that reached this handler (coverage.py's passes it
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # on): what it does to a new interpreter
            os.kill(os.getpid(), signal.SIGTERM)
        for pid in runs:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        sys.exit(0)
    global server_sigterm
    server_sigterm = shut_down
    signal.signal(signal.SIGTERM, shut_down)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    def end(pid):
        """Kill a run whose client is gone, and reap it. Its group, or the run alone if it has not
        made its session yet (then it has started nothing)."""
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.waitpid(pid, 0)
        runs.pop(pid).close()

    while True:
        ready = select.select([listener, *runs.values()], [], [], 0.02)[0]
        while runs:  # report the runs that ended
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            conn = runs.pop(pid)
            tell(conn, os.waitstatus_to_exitcode(status))
            conn.close()
        if os.getppid() != parent:
            shut_down()
        for pid, conn in list(runs.items()):
            if conn in ready and client_gone(conn):  # so goes its run
                end(pid)
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        request, fds = read_request(conn)
        if request is None:  # the client died while it sent
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            listener.close()
            for other in runs.values():
                other.close()
            conn.close()
            become(request, fds)
            os.environ["SPAWN_SOCKET"] = path  # (for the clients this run starts: see client())
            return request
        for fd in fds:
            os.close(fd)
        runs[pid] = conn
        if not tell(conn, pid):  # the client was killed before it learned its run's pid
            end(pid)


def client_gone(conn):
    """True if a run's client has closed its end. A client that closes with the run's pid unread
    resets the connection (Linux's unix sockets), which is gone too."""
    try:
        return not conn.recv(1)
    except ConnectionResetError:
        return True


def read_request(conn):
    """A request's JSON body and fds (see send_request); None for the body if the client died first."""
    header, fds, body = b"", [], b""
    try:
        header, fds, _, _ = socket.recv_fds(conn, 8, 64)
        size = int.from_bytes(header, "little")
        while header and len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                break
            body += chunk
    except ConnectionResetError:
        return None, fds
    return (json.loads(body) if header and len(body) == size else None), fds


def tell(conn, value):
    """One line to a run's client; False if the client has closed its end (it was killed)."""
    try:
        conn.sendall(f"{value}\n".encode())
        return True
    except (BrokenPipeError, ConnectionResetError):
        return False


def send_request(sock, request, fds):
    """A run's request: its fds (by number in the run: request["fds"]) and JSON body."""
    body = json.dumps(request).encode()
    socket.send_fds(sock, [len(body).to_bytes(8, "little")], fds)
    sock.sendall(body)


# ---- a client: a process that asks the server to run it --------------------------------------
def client(argv):
    """`spawn.py --client [-u] ARGV`: run `python ARGV` through the fork server ($SPAWN_SOCKET) as this
    process, which torchrun takes for its worker (PYTHON_EXEC, see conftest.torchrun). The run gets
    this process's environment, directory and stdio; signals sent here go on to it; its exit
    status is this process's; a SIGKILL here ends it too (the server sees the connection close)."""
    if "SPAWN_SOCKET" not in os.environ:  # (not started by a run: be the Python it stands for)
        os.execv(sys.executable, [sys.executable, *argv])
    argv = [a for a in argv if a != "-u"]  # (the runs are unbuffered)
    pid, early = None, []  # the run's pid once the server has sent it; the signals that came before

    def pass_on(sig, _):
        if pid is None:
            early.append(sig)
        else:
            os.kill(pid, sig)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT):
        signal.signal(sig, pass_on)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.environ["SPAWN_SOCKET"])
    send_request(sock, dict(argv=argv, nproc=None, env=dict(os.environ), cwd=os.getcwd(), fds=[0, 1, 2]), [0, 1, 2])
    reader = sock.makefile("rb")
    pid = int(reader.readline())
    for sig in early:
        os.kill(pid, sig)
    line = reader.readline()
    code = int(line) if line else -signal.SIGKILL
    if code < 0:  # killed by a signal: so is this process
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


# ---- the test's side --------------------------------------------------------------------------
class Server:
    """This pytest worker's fork server: started on first use, stopped with the session."""

    def __init__(self, folder, env):
        self.path = os.path.join(folder, "spawn.sock")
        self.python = os.path.join(folder, "python")  # `python ARGV` through the server, as a program
        with open(self.python, "w") as f:
            f.write(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {os.path.dirname(__file__)!r})\n"
                    "import spawn\nspawn.client(sys.argv[1:])\n")
        os.chmod(self.python, 0o755)
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", self.path], env=env,
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
        line = self.proc.stdout.readline()
        if line != b"ready\n":
            self.proc.kill()
            raise RuntimeError(f"the fork server did not start (exit {self.proc.wait()})")

    def start(self, argv, nproc, env, cwd):
        """Start `python ARGV` (nproc None) or ARGV on nproc ranks; returns a Popen-like Run."""
        return Run(self.path, dict(argv=[str(a) for a in argv], nproc=nproc, env=env, cwd=str(cwd)))

    def close(self):
        self.proc.terminate()
        self.proc.wait()
        for path in (self.path, self.python):
            os.unlink(path)
        os.rmdir(os.path.dirname(self.path))


class Run:
    """A run the server forked, as the test sees it: subprocess.Popen's pid, poll, wait,
    communicate (text), send_signal and returncode."""

    def __init__(self, path, request):
        self.returncode = None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        devnull = os.open(os.devnull, os.O_RDONLY)
        send_request(self.sock, dict(request, fds=[0, 1, 2]), [devnull, out_w, err_w])
        for fd in (devnull, out_w, err_w):
            os.close(fd)
        self.pipes = {out_r: bytearray(), err_r: bytearray()}
        self.open = set(self.pipes)
        self.status = b""
        self.pid = int(self._line(None))

    def _line(self, timeout):
        """The server's next line for this run (its pid, then its exit code); None on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.status:
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            if not select.select([self.sock], [], [], left)[0]:
                return None
            chunk = self.sock.recv(64)
            if not chunk:
                raise RuntimeError("the fork server went away")
            self.status += chunk
        line, self.status = self.status.split(b"\n", 1)
        return line

    def poll(self):
        if self.returncode is None:
            line = self._line(0)
            if line is not None:
                self.returncode = int(line)
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired("fork server run", timeout)
            self.returncode = int(line)
        return self.returncode

    def communicate(self, timeout=None):
        """(stdout, stderr) once the run has exited and closed both; TimeoutExpired keeps what was
        read, for the next call."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            for fd in self.open:
                sel.register(fd, selectors.EVENT_READ)
            while self.open:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired("fork server run", timeout)
                for key, _ in sel.select(left):
                    chunk = os.read(key.fd, 65536)
                    if chunk:
                        self.pipes[key.fd] += chunk
                    else:
                        sel.unregister(key.fd)
                        os.close(key.fd)
                        self.open.discard(key.fd)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0.001))
        self.sock.close()
        out, err = (bytes(b).decode(errors="replace") for b in self.pipes.values())
        return out, err

    def send_signal(self, sig):
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # (ended, its status not yet read: as Popen does)
                pass

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def terminate(self):
        self.send_signal(signal.SIGTERM)


def main():
    if sys.argv[1] == "--client":
        client(sys.argv[2:])
    if sys.argv[1] == "--serve":
        request = serve(sys.argv[2])  # (returns in a forked child only)
        leave(child_main(request))

    def start_rank(env):
        return subprocess.Popen([sys.executable, *sys.argv[2:]], env={**os.environ, **env}).pid
    sys.exit(run_ranks(int(sys.argv[1]), start_rank))


if __name__ == "__main__":
    main()
