"""
A plan as a CUDA memory snapshot: the caching allocator's replay (cuda.py) in the format of
torch.cuda.memory._snapshot(), which PyTorch's readers take (python -m torch.cuda._memory_viz stats,
trace, trace_plot; pytorch.org/memory_viz). Each allocation's frames name what the plan knows of it:
the storage's role and the moment it is made (the phase and the module at work).
"""
import bisect
import pickle

from .cuda import CUBLAS_WORKSPACES

# the workspaces cuda_model() puts first, one per thread that multiplies
WORKSPACES = ("cuBLAS workspace, the forward's thread", "cuBLAS workspace, autograd's thread")
WORKSPACE_ROLE = "cublas_workspace"


def memory_snapshot(counter, model, exclude=()):
    """torch.cuda.memory._snapshot()'s dict for `model`, a CachingAllocatorModel replayed with
    log=True over cuBLAS's workspaces and the counter's trace less the storages in `exclude`
    (offload's host side): "segments", the model's final state, and "device_traces", its events."""
    role = counter.lifetime_roles() | counter.role_of  # (as the timeline colours them)
    kept = [i for i, (number, _) in enumerate(counter.trace) if number not in exclude] if exclude else None
    where = moments(counter)
    named = {}  # (role, moment) -> its frames: one list for all, which pickle then writes once

    def frames(at):
        """The frames of the replay's event `at`: the storage's role, and the moment."""
        if at < CUBLAS_WORKSPACES:
            key = (WORKSPACE_ROLE, WORKSPACES[at % len(WORKSPACES)])
        else:
            index = kept[at - CUBLAS_WORKSPACES] if kept is not None else at - CUBLAS_WORKSPACES
            key = (role[counter.trace[index][0]], where(index))
        if key not in named:
            named[key] = [{"filename": f"role: {key[0]}", "line": 0, "name": key[1]}]
        return named[key]

    events, held = [], {}  # held: storage number -> (bytes asked, frames) of its live block
    for kind, at, *rest in model.log:
        if kind == "segment_alloc":  # (CUDA records it before the allocation that asked for it)
            address, size = rest
            events.append(event("segment_alloc", address, size, frames(at), len(events)))
        elif kind == "alloc":
            number, address, size, nbytes = rest
            held[number] = (nbytes, frames(at))
            events.append(event("alloc", address, size, held[number][1], len(events)))
        else:  # one stream: each free completes at once
            number, address, size = rest
            for action in ("free_requested", "free_completed"):
                events.append(event(action, address, size, frames(at), len(events)))
    return {"segments": segments(model, held), "device_traces": [events]}


def event(action, address, size, frames, time):
    """A trace entry. Its size is the block's, not the bytes asked as CUDA's own trace has it: the
    events then add up to the allocated bytes the plan reports (cuda_allocated_bytes)."""
    return {"action": action, "addr": address, "size": size, "stream": 0, "frames": frames, "time_us": time}


def segments(model, held):
    """The model's segments as the snapshot's: each with its blocks, allocated or inactive."""
    out = []
    for segment, small, blocks in model.layout():
        base, listed = model.bases[segment], []
        for offset, size, number in blocks:
            if number is None:
                listed.append({"address": base + offset, "size": size, "requested_size": 0, "state": "inactive",
                               "frames": []})
            else:
                nbytes, frames = held[number]
                listed.append({"address": base + offset, "size": size, "requested_size": nbytes,
                               "state": "active_allocated", "frames": frames})
        active = [b for b in listed if b["state"] == "active_allocated"]
        out.append({"device": 0, "address": base, "total_size": sum(b["size"] for b in listed), "stream": 0,
                    "segment_type": "small" if small else "large", "segment_pool_id": (0, 0),
                    "is_expandable": False, "allocated_size": sum(b["size"] for b in active),
                    "active_size": sum(b["size"] for b in active),
                    "requested_size": sum(b["requested_size"] for b in active), "frames": [], "blocks": listed})
    return out


def moments(counter):
    """index in the trace -> the moment it happens: the phase (marks), and the module at work
    where a block's forward or backward has begun in that phase (units: "step 2 backward 0 @ h.3")."""
    marks, units = [i for i, _ in counter.marks], [i for i, _ in counter.units]

    def where(index):
        mark, unit = bisect.bisect_right(marks, index) - 1, bisect.bisect_right(units, index) - 1
        phase = counter.marks[mark][1] if mark >= 0 else "setup"
        if unit >= 0 and units[unit] >= (marks[mark] if mark >= 0 else 0):
            name = counter.units[unit][1]
            if name.split(" @ ")[0] == phase:  # (a unit of the phase before, at the mark's index: not this one's)
                return name
        return phase
    return where


def write(snapshot, path):
    """The snapshot to `path`, as torch.cuda.memory._dump_snapshot() writes it: pickled, at protocol 4,
    the newest that pytorch.org/memory_viz's own unpickler reads."""
    with open(path, "wb") as f:
        pickle.dump(snapshot, f, protocol=4)
