"""
The collectives, in one place, and the ledger that tests and bench.py read.

Every collective is issued asynchronously (`async_op=True`) and returns a work handle; the
caller decides when to wait. On CUDA the handle's wait() makes the current stream wait on
NCCL's stream (no host block), on gloo it blocks the host until the transfer is done, so on
both the communication runs while the caller computes, until the wait.

`ledger` counts collectives and bytes and, when `ledger.events` is a list, logs the order of
events (all-gather issued / waited, forward / backward of a unit, reduce-scatter issued /
waited, free). Logging costs one `if` per event when off.
"""
import functools
import os
import queue
import threading
import weakref
from concurrent.futures import Future
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from . import shm


class Ledger:
    def __init__(self):
        self.reset()

    def reset(self, record_events=False):
        self.counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        self.bytes = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        self.events = [] if record_events else None

    def log(self, event, unit):
        if self.events is not None:
            self.events.append((event, unit))

    def count(self, kind, nbytes):
        self.counts[kind] += 1
        self.bytes[kind] += nbytes


ledger = Ledger()


NOTHING = nullcontext()  # (one, shared: creating one costs a call per use, on every unit's hot path)


def profiled(name):
    """A named range in profiler traces (free when no profiler is running)."""
    return record_function(name) if torch.autograd.profiler._is_profiler_enabled else NOTHING


def begin_range(name):
    """Open a named profiler range that a later hook closes with end_range(): a unit's forward or
    backward spans two hooks, so it cannot be a `with` block. None when no profiler is running."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return None
    profiler_range = record_function(name)
    profiler_range.__enter__()
    return profiler_range


def end_range(profiler_range):
    if profiler_range is not None:
        profiler_range.__exit__(None, None, None)


_OLDER_NAMES = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


def library_collective(name):
    """torch.distributed's collective by its torch 2.13 name, or by its older one on earlier releases
    (the GPU machines' 2.11), which 2.13 keeps as a deprecated alias. Looked up at each call, so that
    observe.py's counting wrappers see it."""
    return getattr(dist, name, None) or getattr(dist, _OLDER_NAMES[name])


def goes_point_to_point(group, device):
    """Whether collectives over `group` go point to point, as messages between ranks: gloo with CPU
    tensors and more than one rank (see exchange)."""
    return group.size() > 1 and device.type == "cpu" and dist.get_backend(group) == "gloo"


# tags keep the messages of an all-gather and a reduce-scatter in flight at once apart. The group
# is the caller's too, and gloo matches messages by (peer, tag): so from the top of the range, away
# from the small tags a training loop's own send/recv use (with tag 1 they took each other's messages)
TAGS = {"all_gather": 2**31 - 2, "reduce_scatter": 2**31 - 1}


class _Exchange:
    """Point-to-point messages that together do one collective; wait() waits until the posting
    thread has posted them, then for each of them. With none (one rank: the work is a local
    copy) it is complete at once."""

    def __init__(self, posted=None):
        self.posted = posted  # a Future of the messages' works

    def wait(self):
        if self.posted is not None:
            for work in self.posted.result():
                work.wait()
        self.finish()

    def finish(self):
        pass


class _PostingThread:
    """One thread that runs the exchanges in the order they were issued; submit() returns a Future.

    A daemon, unlike a ThreadPoolExecutor's worker, which the interpreter waits for at exit: an
    exchange through shared memory waits for its peer, and a process whose training thread raised
    must still exit, since its exit is how the peers learn of the failure."""

    def __init__(self):
        self.queue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="fsdp_impl-post", daemon=True).start()

    def submit(self, fn, *args):
        future = Future()
        self.queue.put((future, functools.partial(fn, *args)))
        return future

    def _run(self):
        while True:
            future, job = self.queue.get()
            try:
                result, error = job(), None
            except BaseException as e:  # (the caller's wait() raises it)
                result, error = None, e
            # dropped before the caller learns it is done: kept until the next job, it kept this job's
            # tensors alive (after backward, the unsharded gradients of its last reduce-scatter)
            job = None
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)


_poster = None  # the posting thread (see exchange), started by the first exchange
# False: the exchanges keep gloo's messages even where the ranks share a host (read at a group's
# first exchange; train.py's shared_memory setting)
shared_memory = True
_channels = weakref.WeakKeyDictionary()  # group -> shm.Channels, or None where it keeps gloo's messages


def exchange(kind, nbytes, sends, recvs, group):
    """Have the posting thread move the bytes that together do one collective of `kind` on gloo;
    returns a Future of the messages' works (none through shared memory: done when it is done).

    gloo's own collectives allocate buffers of the whole collective's size per call and copy
    through them (a fresh unit-sized allocation each time, on new heap pages on CPU; see
    IMPLEMENTATION.md); exchanges go straight between the caller's tensors. `sends` and `recvs`
    are (peer's rank in `group`, tensor) in an order both ends share. Where every rank of the group
    runs on this host the bytes go through shared memory (shm.py), elsewhere as gloo's messages:
    gloo matches the messages between two ranks in the order they were posted, and one thread
    posts them all, in the order of the calls. Empty tensors are skipped (both ends know the
    sizes). `nbytes` is the collective's size (the all-gather's output, the reduce-scatter's
    input): counted here, and by observe.py's counter, which wraps this function.

    Why a thread of its own: gloo's TCP transport writes a message's bytes into the socket on
    the thread that posts the send, whenever the peer's receive is posted already, and posting
    a receive waits for the connection's lock while gloo's own thread reads. Posted by the
    training thread, the rank that came later to an exchange did that work in its training
    thread, so it stayed later, and the other rank waited for it at the end of backward (27 ms
    of a 236 ms profiled step, 5M parameters; IMPLEMENTATION.md). Through shared memory it is the
    thread that copies the bytes, for the same reason.
    """
    global _poster
    ledger.count(kind, nbytes)
    if _poster is None:
        _poster = _PostingThread()
    return _poster.submit(_post, kind, sends, recvs, group)


def posting_thread_started():
    """Whether this process posts messages from the posting thread (an exchange has run)."""
    return _poster is not None


def _forget_the_posting_thread():
    """In a forked child: fork copies only the thread that forked, so the parent's posting thread is
    not there (an exchange would wait for it for ever), and the parent's channels are not the
    child's to use. Its first exchange starts afresh."""
    global _poster
    _poster = None
    _channels.clear()


if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(after_in_child=_forget_the_posting_thread)


def _post(kind, sends, recvs, group):
    if group not in _channels:  # the group's first exchange: both ends connect here, in the same place
        _channels[group] = shm.connect(group, lambda s, r: post_messages(kind, s, r, group), shared_memory)
    if _channels[group] is not None:  # one host: the bytes go through shared memory (shm.py), not TCP
        with profiled(f"shm:{kind}"):  # (a communication range for fsdp_impl.overlap, as gloo's are)
            _channels[group].transfer(sends, recvs, TAGS[kind])
        return []
    return post_messages(kind, sends, recvs, group)


def post_messages(kind, sends, recvs, group):
    """Post (peer, tensor) sends and receives as gloo messages with `kind`'s tag; their works."""
    works = []
    # sends first: with the receives posted first (and the all-gather's own copy before both), a
    # training step measured about 5% slower (5M parameters; IMPLEMENTATION.md)
    for post, messages in ((dist.isend, sends), (dist.irecv, recvs)):
        for peer, tensor in messages:
            if tensor.numel():
                works.append(post(tensor, dist.get_global_rank(group, peer), group=group, tag=TAGS[kind]))
    return works


def all_gather(slots, pieces, group):
    """Every rank's pieces[i] into slots[i][rank], where slots[i] is [W, pieces[i].numel()]. Returns a handle.

    With one rank there is nothing to gather: a copy (FSDP2 skips the collective too). On gloo
    with CPU tensors each piece goes to every peer as a message of its own, straight into its
    slot, so the gathered tensors need no copy out of a rank-major buffer; no arithmetic, so the
    bits are the same. Elsewhere one library all-gather, into a single rank-major slot.
    """
    nbytes = sum(s.numel() * s.element_size() for s in slots)
    if group.size() == 1:
        ledger.count("all_gather", nbytes)
        for slot, piece in zip(slots, pieces):
            slot[0].copy_(piece, non_blocking=True)  # (asynchronous from a pinned, offloaded shard)
        return _Exchange()
    if goes_point_to_point(group, slots[0].device):
        me = group.rank()
        peers = [peer for peer in range(group.size()) if peer != me]
        posted = exchange("all_gather", nbytes, [(peer, piece) for peer in peers for piece in pieces],
                          [(peer, slot[peer]) for peer in peers for slot in slots], group)
        torch._foreach_copy_([slot[me] for slot in slots], list(pieces))  # (while the messages travel)
        return _Exchange(posted)
    ledger.count("all_gather", nbytes)
    (output,), (shard,) = slots, pieces
    return library_collective("all_gather_single")(output.view(-1), shard, group=group, async_op=True)


def reduce_scatter(output, input, group):
    """Average `input` (rank-major chunks) over the group; this rank's chunk lands in `output`.

    With one rank there is nothing to reduce: a copy, as FSDP2 does. With two ranks on gloo
    (CPU tensors) the halves are exchanged (reduce_scatter_pair); otherwise the library's
    reduce-scatter.
    """
    if group.size() == 2 and goes_point_to_point(group, input.device):
        halves = input.view(2, -1)
        return reduce_scatter_pair(output, [output], [halves[group.rank()]], [halves[1 - group.rank()]], group)
    ledger.count("reduce_scatter", input.numel() * input.element_size())
    if group.size() == 1:
        output.copy_(input)
        return _Exchange()
    return library_collective("reduce_scatter_single")(output, input, op=dist.ReduceOp.AVG, group=group,
                                                       async_op=True)


def reduce_scatter_pair(output, landings, own, theirs, group):
    """Reduce-scatter of two ranks on gloo, piece by piece: send the peer `theirs` (its rows of each
    tensor), receive its `own` counterparts into `landings` (views of `output`), add ours at wait()
    and halve. Returns a handle.

    gloo's reduce-scatter is a whole all-reduce plus copies: each rank receives every chunk
    reduced, twice the bytes it needs, into buffers of the input's size. Here each rank sends
    and receives half, and the pieces can be taken from wherever they are (the unsharded
    gradients themselves), with no rank-major input to copy them into. (a + b) / 2 is gloo's
    answer bit for bit in either order; with more ranks gloo's summation order depends on its
    internal segmentation, so its collective stays there, for FSDP2's exact bits.
    """
    peer = 1 - group.rank()
    posted = exchange("reduce_scatter", 2 * output.numel() * output.element_size(),
                      [(peer, t) for t in theirs], [(peer, t) for t in landings], group)
    return _PairReduction(output, landings, own, posted)


class _PairReduction(_Exchange):
    def __init__(self, output, landings, own, posted):
        super().__init__(posted)
        self.output, self.landings, self.own = output, landings, own

    def finish(self):
        torch._foreach_add_(self.landings, self.own)
        self.output.div_(2)
        self.landings = self.own = None  # (the unsharded gradients they view are freed)


def all_reduce_mean(tensor, group):
    """Average `tensor` in place across the group (HSDP: across replicas)."""
    ledger.count("all_reduce", tensor.numel() * tensor.element_size())
    return dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group, async_op=True)
