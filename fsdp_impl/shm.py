"""
Shared memory between the ranks of one host: how comm.py's exchanges move their bytes on CPU.

gloo's point-to-point messages go through loopback TCP: copied into the kernel, out again, and
handled by gloo's event-loop thread. On this project's CPU machine a 256 MB all-gather took 125 ms
of rank 0's CPU that way, 72 ms through shared memory (IMPLEMENTATION.md, "Shared memory"). Here
each ordered pair of ranks (sender, receiver) shares a channel: a file in /dev/shm that both map,
holding two slots of 1 MB and two process-shared semaphores (slots filled, slots free). The sender
copies the next piece of its bytes into a free slot and posts `filled`; the receiver waits for it,
copies the slot out and posts `free`. That is two memcpys per byte, and no socket.

An exchange is, for every peer, the tensors to send it and the tensors to receive from it, read as
one stream of bytes each way. Both ends agree on their sizes, as they do for gloo's messages. The
posting thread runs the exchanges one at a time, in the order they were issued. Every rank issues
the same collectives in the same order (NCCL asks the same of FSDP2; across groups too, since one
thread runs them all), so both ends of a channel walk through its slots in the same order. Each
slot carries its exchange's number, tag (the kind of collective, as gloo's message tags tell them
apart) and size, which the receiver checks: ranks that issued different collectives get an error,
not each other's bytes.

The ranks connect at their first exchange on a group, with gloo messages (connect). A group uses
shared memory only if every rank of it can open every peer's channel files, which means one host.
Otherwise, and off Linux, the group keeps gloo's messages. The files are unlinked as soon as
everyone has tried to open them, and on any error: only a process killed in those milliseconds
leaves them in /dev/shm.
"""
import ctypes
import errno
import mmap
import os
import secrets
import sys
import time

import torch
import torch.distributed as dist

SLOTS, SLOT_BYTES = 2, 1 << 20  # 1 MB: smaller or larger slots measured slower (IMPLEMENTATION.md)
_SEM_BYTES = 64  # room for one sem_t (32 bytes on 64-bit glibc)
_LABELS = 2 * _SEM_BYTES  # then a label per slot, which the receiver checks:
_LABEL_INTS = 3  # int64s: its exchange's number, tag and size
_HEADER = 4096  # the slots start on a page of their own
_FILE_BYTES = _HEADER + SLOTS * SLOT_BYTES


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc():
    """glibc's semaphore functions, or None where there are none to share (not Linux, no /dev/shm)."""
    if not sys.platform.startswith("linux") or not os.path.isdir("/dev/shm"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sem_init.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint)
    libc.sem_post.argtypes = (ctypes.c_void_p,)
    libc.sem_timedwait.argtypes = (ctypes.c_void_p, ctypes.POINTER(_Timespec))
    return libc


_lib = _libc()


def _path(pid, token, receiver):
    return f"/dev/shm/fsdp_impl-{pid}-{token:x}-{receiver}"


def _started(pid):
    """When process `pid` started (clock ticks since boot), or None if it is gone; a zombie, dead but
    not yet reaped by its parent, counts as gone. With the pid it names one process: a peer in
    another PID namespace, whose pid here is some other process or none, does not match."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except FileNotFoundError:
        return None
    return None if fields[0] in "ZX" else int(fields[19])


def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fsdp_impl: {what}: {os.strerror(err)}")


class _Channel:
    """One direction between two ranks: a file in /dev/shm, mapped by both."""

    def __init__(self, path, create):
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:  # (reserves the pages: a full /dev/shm fails here, not with SIGBUS on a write)
                os.posix_fallocate(fd, 0, _FILE_BYTES)
            self._map = mmap.mmap(fd, _FILE_BYTES)
            base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
            self.filled, self.free = base, base + _SEM_BYTES
            if create:
                _check(_lib.sem_init(self.filled, 1, 0), "sem_init")
                _check(_lib.sem_init(self.free, 1, SLOTS), "sem_init")
        except OSError:
            if create:
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.labels = (ctypes.c_int64 * (_LABEL_INTS * SLOTS)).from_buffer(self._map, _LABELS)
        self.slots = [base + _HEADER + i * SLOT_BYTES for i in range(SLOTS)]
        self.used = 0  # slots used so far; both ends count alike


class _Stream:
    """The bytes of a list of contiguous tensors, back to back, moved a slot at a time."""

    def __init__(self, tensors):
        self.pieces = []
        for t in tensors:
            if not t.is_contiguous():  # (gloo's isend refuses them too)
                raise ValueError("fsdp_impl: an exchange's tensors must be contiguous")
            ptr, size = t.data_ptr(), t.numel() * t.element_size()
            if self.pieces and self.pieces[-1][0] + self.pieces[-1][1] == ptr:  # (an all-gather's pieces of
                self.pieces[-1][1] += size                                     # the flat shard: one copy)
            elif size:
                self.pieces.append([ptr, size])
        self.total = self.left = sum(n for _, n in self.pieces)
        self.index = self.done = 0  # the piece under way, and its bytes moved

    def move(self, slot, nbytes, into_slot):
        """Copy the next `nbytes` into the slot at address `slot`, or out of it."""
        self.left -= nbytes
        at = 0
        while at < nbytes:
            ptr, size = self.pieces[self.index]
            n = min(size - self.done, nbytes - at)
            if into_slot:
                ctypes.memmove(slot + at, ptr + self.done, n)
            else:
                ctypes.memmove(ptr + self.done, slot + at, n)
            at += n
            self.done += n
            if self.done == size:
                self.index, self.done = self.index + 1, 0


class Channels:
    """A rank's channels to and from every peer of one group."""

    def __init__(self, outgoing, incoming, peers, timeout_s):
        self.outgoing, self.incoming, self.timeout_s = outgoing, incoming, timeout_s
        self.peers = peers  # {peer: (pid, start time)}: the processes whose exit is an error
        self.exchanges = 0  # exchanges so far; every rank of the group counts alike
        self.failed = None  # the error that left the channels out of step: later exchanges raise at once

    def transfer(self, sends, recvs, tag):
        """Move one exchange: (peer, tensor) pairs to send and to receive, in an order both ends share;
        `tag` tells the kinds of collective apart (an all-gather and a reduce-scatter of one unit move
        as many bytes)."""
        if self.failed is not None:
            raise RuntimeError("fsdp_impl: an earlier exchange on this group failed") from self.failed
        self.exchanges += 1
        outs = {p: _Stream([t for q, t in sends if q == p]) for p in self.outgoing}
        ins = {p: _Stream([t for q, t in recvs if q == p]) for p in self.incoming}
        try:
            self._send_a_slot(outs, tag)  # one slot ahead, so both slots of a channel are in use
            while any(s.left for s in ins.values()) or any(s.left for s in outs.values()):
                self._send_a_slot(outs, tag)
                for peer, stream in ins.items():
                    if stream.left:
                        self._receive_a_slot(peer, stream, tag)
        except BaseException as e:
            self.failed = e
            raise

    def _send_a_slot(self, outs, tag):
        for peer, stream in outs.items():
            if stream.left:
                channel = self.outgoing[peer]
                self._wait(channel.free, peer)
                slot = channel.used % SLOTS
                channel.labels[_LABEL_INTS * slot:_LABEL_INTS * (slot + 1)] = self.exchanges, tag, stream.total
                stream.move(channel.slots[slot], min(SLOT_BYTES, stream.left), into_slot=True)
                channel.used += 1
                _check(_lib.sem_post(channel.filled), "sem_post")

    def _receive_a_slot(self, peer, stream, tag):
        channel = self.incoming[peer]
        self._wait(channel.filled, peer)
        slot = channel.used % SLOTS
        number, sent_tag, size = channel.labels[_LABEL_INTS * slot:_LABEL_INTS * (slot + 1)]
        if (number, sent_tag, size) != (self.exchanges, tag, stream.total):
            raise RuntimeError(f"fsdp_impl: rank {peer} of the group sent {size} bytes in its exchange {number} (tag "
                               f"{sent_tag}) where this rank expects {stream.total} in its exchange {self.exchanges} "
                               f"(tag {tag}): the ranks issued different collectives")
        stream.move(channel.slots[slot], min(SLOT_BYTES, stream.left), into_slot=False)
        channel.used += 1
        _check(_lib.sem_post(channel.free), "sem_post")

    def _wait(self, semaphore, peer):
        """Wait on a semaphore the peer posts, a second at a time: a peer that exited, or one silent
        for longer than the group's timeout, is an error here (as a gloo message's wait would be)."""
        start = time.monotonic()
        while True:
            deadline = _Timespec(*divmod(time.time_ns() + 10**9, 10**9))
            if _lib.sem_timedwait(semaphore, ctypes.byref(deadline)) == 0:
                return
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err != errno.ETIMEDOUT:
                raise OSError(err, f"fsdp_impl: waiting on shared memory: {os.strerror(err)}")
            if _started(self.peers[peer][0]) != self.peers[peer][1]:
                raise RuntimeError(f"fsdp_impl: rank {peer} of the group exited in the middle of an exchange")
            if time.monotonic() - start > self.timeout_s:
                raise RuntimeError(f"fsdp_impl: timed out after {self.timeout_s:.0f} s waiting for rank {peer} of the "
                                   "group in an exchange (the process group's timeout)")


def _swap(values, peers, post):
    """Send `values` (ints) to every peer and receive each peer's: {peer: [ints]}."""
    mine = torch.tensor(values, dtype=torch.int64)
    theirs = {p: torch.empty_like(mine) for p in peers}
    for work in post([(p, mine) for p in peers], [(p, theirs[p]) for p in peers]):
        work.wait()
    return {p: t.tolist() for p, t in theirs.items()}


def _timeout_s(group):
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):  # (private: the default where it is not there)
        return dist.default_pg_timeout.total_seconds()


def connect(group, post, wanted=True):
    """Channels to and from every peer of `group`, or None if any rank of it cannot use them (another
    host, no /dev/shm, `wanted` False on some rank). Every rank of the group calls it, in the same
    place of its sequence of exchanges. `post(sends, recvs)` posts gloo messages and returns their
    works (comm.post_messages); three small ones go to each peer: who this rank is (and whether it
    can share), whether it made its files, whether it opened its peers'."""
    me, pid, token = group.rank(), os.getpid(), secrets.randbits(62)
    peers = [p for p in range(group.size()) if p != me]
    able = wanted and _lib is not None
    found = _swap([pid, _started(pid), token, int(able)], peers, post)  # every rank is here now
    if not (able and all(ok for *_, ok in found.values())):
        return None
    outgoing, incoming = {}, {}
    try:
        try:
            for p in peers:
                outgoing[p] = _Channel(_path(pid, token, p), create=True)
        except OSError:  # (a full /dev/shm, say)
            pass
        made = _swap([int(len(outgoing) == len(peers))], peers, post)
        if len(outgoing) == len(peers) and all(ok for (ok,) in made.values()):
            try:
                for p, (peer_pid, peer_start, peer_token, _) in found.items():
                    if _started(peer_pid) != peer_start:  # (its files are here, its process is not seen)
                        raise OSError(errno.ESRCH, "peer not seen")
                    incoming[p] = _Channel(_path(peer_pid, peer_token, me), create=False)
            except OSError:  # (another host: its files are not here)
                incoming = {}
        opened = _swap([int(len(incoming) == len(peers))], peers, post)
    finally:  # every peer has opened this rank's files, or given up, or failed: the names can go
        for p in outgoing:
            os.unlink(_path(pid, token, p))
    if len(incoming) < len(peers) or not all(ok for (ok,) in opened.values()):
        return None
    return Channels(outgoing, incoming, {p: (found[p][0], found[p][1]) for p in peers}, _timeout_s(group))
