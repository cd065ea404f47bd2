"""
fsdp_impl.shm between real processes, launched by tests/test_shm.py through tests/spawn.py at 2 and
3 ranks. Each scenario runs on a fresh group; rank 0 writes every rank's findings as JSON.

    python tests/spawn.py W tests/shm_worker.py OUT.json
    python tests/spawn.py 2 tests/shm_worker.py --raise-while-exchanging

The second raises on rank 0 while an exchange through shared memory waits for rank 1, which never
joins it: rank 0 must still exit (tests/test_shm.py times the launch).
"""
import errno
import glob
import json
import os
import sys
import time
import traceback
import weakref
from contextlib import nullcontext
from unittest import mock

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_impl import comm, shm  # noqa: E402

SLOT = shm.SLOT_BYTES


def poster(group):
    """What comm.py hands shm.connect: posting gloo messages on `group`."""
    return lambda sends, recvs: comm.post_messages("all_gather", sends, recvs, group)


def stream(sender, receiver, numel=None):
    """What `sender` sends `receiver`: tensors of assorted sizes and dtypes (empty ones, single
    elements, and some that cross the slots' boundaries), a different length each way. By default
    it starts with pieces of one buffer, back to back as an all-gather's pieces of a flat shard
    are (copied as one piece)."""
    g = torch.Generator().manual_seed(1000 * sender + receiver)
    if numel:
        return [torch.randint(0, 200, (n,), generator=g).float() for n in numel]
    joined = [3, 0, SLOT // 4 + 5, 1, SLOT // 8]  # float32 elements: 1.4 slots in all
    sizes = [0, 1, 7, 3 * SLOT // 16 + 3, 5, SLOT // 4, 2 * SLOT // 4 + 1, 0, 1000, 13 * (sender + 1)]
    dtypes = (torch.float32, torch.bfloat16, torch.int64, torch.uint8)
    return (list(torch.randint(0, 200, (sum(joined),), generator=g).float().split(joined))
            + [torch.randint(0, 200, (n,), generator=g).to(dtypes[i % len(dtypes)]) for i, n in enumerate(sizes)])


def exchange(channels, me, peers, numel=None, expected_from=None, tag=0):
    """One transfer of the streams above; True if every received tensor is the sender's, bit for bit."""
    sends = [(p, t) for p in peers for t in stream(me, p, numel)]
    expected = [(p, t) for p in peers for t in stream(p, me, (expected_from or {}).get(p, numel))]
    recvs = [(p, torch.full_like(t, 255)) for p, t in expected]
    channels.transfer(sends, recvs, tag)
    return all(torch.equal(r, e) for (_, r), (_, e) in zip(recvs, expected))


def attempt(fn):
    try:
        return fn()
    except Exception as e:
        return {"raised": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}


def raise_while_exchanging():
    dist.init_process_group("gloo")
    group, rank = dist.group.WORLD, dist.get_rank()
    full, piece = torch.zeros(2, 4), torch.zeros(4)
    comm.all_gather([full], [piece], group).wait()  # both ranks: connected through shared memory
    dist.barrier()
    if rank == 0:
        comm.all_gather([full], [piece], group)  # waits for rank 1 on the posting thread, for ever
        raise RuntimeError("rank 0 failed with an exchange in flight")
    time.sleep(120)  # rank 1 is busy elsewhere; tests/spawn.py stops it once rank 0 has exited


def main():
    if sys.argv[1] == "--raise-while-exchanging":
        return raise_while_exchanging()
    out_path = sys.argv[1]
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    peers = [p for p in range(world) if p != rank]
    mine = {}

    group = dist.new_group(list(range(world)))
    channels = shm.connect(group, poster(group))
    mine["connected"] = channels is not None
    mine["files_left"] = glob.glob(f"/dev/shm/fsdp_impl-{os.getpid()}-*")
    mine["bytes_match"] = [attempt(lambda: exchange(channels, rank, peers)) for _ in range(3)]  # slots reused

    group = dist.new_group(list(range(world)))  # the tensors of an exchange waited for are the caller's alone
    piece, full = torch.ones(4), torch.zeros(world, 4)
    refs = [weakref.ref(piece), weakref.ref(full)]
    comm.all_gather([full], [piece], group).wait()
    del piece, full
    mine["freed_after_wait"] = [ref() is None for ref in refs]

    group = dist.new_group(list(range(world)))  # a rank without it: the whole group keeps gloo's messages
    mine["one_rank_unwilling"] = shm.connect(group, poster(group), wanted=rank != world - 1) is None

    group = dist.new_group(list(range(world)))  # the last rank is on "another machine": its peers' files are not there
    real = shm._Channel

    def elsewhere(path, create):
        if not create:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        return real(path, create)
    with mock.patch.object(shm, "_Channel", elsewhere) if rank == world - 1 else nullcontext():
        mine["another_machine"] = shm.connect(group, poster(group)) is None
    mine["files_left_after_another_machine"] = glob.glob(f"/dev/shm/fsdp_impl-{os.getpid()}-*")

    group = dist.new_group(list(range(world)))  # /dev/shm is full on the last rank: nobody uses it, no file is left
    full = OSError(errno.ENOSPC, "No space left on device")
    with mock.patch.object(os, "posix_fallocate", side_effect=full) if rank == world - 1 else nullcontext():
        mine["dev_shm_full"] = shm.connect(group, poster(group)) is None
    mine["files_left_after_full"] = glob.glob(f"/dev/shm/fsdp_impl-{os.getpid()}-*")

    group = dist.new_group(list(range(world)))  # rank 0 sends fewer bytes than its peers expect
    channels = shm.connect(group, poster(group))
    short = {0: [100]} if rank != 0 else None
    mine["size_mismatch"] = attempt(lambda: exchange(channels, rank, peers, numel=[96], expected_from=short))

    group = dist.new_group(list(range(world)))  # as many bytes, but rank 0's exchange is of another kind
    channels = shm.connect(group, poster(group))
    mine["other_kind"] = attempt(lambda: exchange(channels, rank, peers, numel=[96], tag=1 if rank == 0 else 2))

    group = dist.new_group(list(range(world)))  # the same 3 MB in all, cut into other exchanges by rank 0
    channels = shm.connect(group, poster(group))
    mb = SLOT // 4  # float32 elements in 1 MB
    first = [2 * mb] if rank == 0 else [3 * mb]  # (rank 0 would send its last 1 MB in a second exchange)
    mine["other_cuts"] = attempt(lambda: exchange(channels, rank, peers, numel=first))
    start = time.monotonic()
    mine["after_a_failure"] = attempt(lambda: exchange(channels, rank, peers, numel=[10]))
    mine["after_a_failure_s"] = time.monotonic() - start

    group = dist.new_group(list(range(world)))  # the last rank starts late, past rank 0's timeout
    channels = shm.connect(group, poster(group))
    channels.timeout_s = 2.0
    dist.barrier()
    if rank == world - 1:
        time.sleep(10.0)
    start = time.monotonic()
    mine["silent_peer"] = attempt(lambda: exchange(channels, rank, peers, numel=[10]))
    mine["silent_peer_s"] = time.monotonic() - start

    group = dist.new_group(list(range(world)))  # the last rank exits in the middle of an exchange
    survivors = dist.new_group(list(range(world - 1)))
    channels = shm.connect(group, poster(group))
    dist.barrier()
    if rank == world - 1:
        os._exit(0)  # (exit code 0: tests/spawn.py lets the others finish)
    start = time.monotonic()
    mine["peer_exited"] = attempt(lambda: exchange(channels, rank, peers, numel=[10]))
    mine["peer_exited_s"] = time.monotonic() - start

    everyone = [None] * (world - 1)
    dist.all_gather_object(everyone, mine, group=survivors)
    if rank == 0:
        with open(out_path + ".tmp", "w") as f:
            json.dump({"world": world, "ranks": everyone}, f, indent=1)
        os.replace(out_path + ".tmp", out_path)
    os._exit(0)  # (a member of the default group is gone: no teardown)


if __name__ == "__main__":
    main()
