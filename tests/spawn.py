"""
A small stand-in for `torchrun --standalone --nproc_per_node=N` in the tests: it starts N copies of
a script with the environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and when one exits non-zero it stops the others
(SIGTERM, then SIGKILL after a grace period) and exits with that code, as torchrun does.

It trades torchrun's features (restarts, rendezvous across nodes, its failure report) for start-up
time: torchrun imports torch before it starts a worker, 2-3 s per launch on the CI machine. Tests
of those features launch torchrun itself (conftest.torchrun).

    python tests/spawn.py N script.py [args...]
"""
import os
import random
import signal
import socket
import subprocess
import sys
import time

GRACE_S = 30


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


def main():
    nproc, cmd = int(sys.argv[1]), [sys.executable, *sys.argv[2:]]
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    workers = [subprocess.Popen(cmd, env=dict(base, RANK=str(r), LOCAL_RANK=str(r))) for r in range(nproc)]
    # our own SIGTERM (a test tearing the launcher down) goes on to the workers
    signal.signal(signal.SIGTERM, lambda *_: stop(workers, 143))
    while True:
        codes = [w.poll() for w in workers]  # (every one: the first to fail need not be rank 0)
        failed = [c for c in codes if c not in (None, 0)]
        if failed or None not in codes:
            break
        time.sleep(0.05)
    stop(workers, failed[0] if failed else 0)


def stop(workers, code):
    """Stop what still runs and exit with `code` (a worker killed by a signal reads as 128 + it)."""
    for w in workers:
        if w.poll() is None:
            w.send_signal(signal.SIGTERM)
    deadline = time.time() + GRACE_S
    for w in workers:
        try:
            w.wait(max(deadline - time.time(), 0))
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()
    sys.exit(128 - code if code < 0 else code)


if __name__ == "__main__":
    main()
