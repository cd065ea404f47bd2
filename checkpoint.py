"""
Checkpoints: one format for every backend and every world size.

    out_dir/ckpt-0000250/   a torch.distributed.checkpoint (DCP) directory: every rank writes its
                            own shards; DCP re-shards on load, so a checkpoint written by FSDP at 4
                            ranks resumes under DDP at 1, and the other way round.
        manifest.json       written last: format version, iteration, model args, config, backend,
                            world size, and every file's size and CRC32.
    out_dir/latest          the name of the newest complete checkpoint, replaced atomically.

A crash mid-save leaves a `*.tmp` directory (removed by the next save) and `latest` still naming
the previous checkpoint; in a re-save of the same iteration, the copy it replaces, set aside as
`*.old`, is what `latest` then leads to. Pruning keeps the `keep` saved last, by their save time.
`python checkpoint.py OUT_DIR` exports the latest one as a single OUT_DIR/ckpt.pt.
"""
import json
import os
import re
import shutil
import signal
import time
import warnings
import zlib
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

FORMAT_VERSION = 1
# what the readers (train.py, sample.py, the export below) take from a manifest, beside the version
MANIFEST_FIELDS = {"files": dict, "iter_num": int, "best_val_loss": (float, int), "model_args": dict, "config": dict}
MODEL_ARGS = {"n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size"}  # the model's shape
EXPORT = "ckpt.pt"  # the single-file export of the model alone (the __main__ below), which sample.py reads
NAME = re.compile(r"ckpt-\d{7,}")  # ckpt-<iteration>: what pruning may remove (not a copy named ckpt-0000020-good)


def _dcp(op, state, path):
    """dcp.save or dcp.load, without the warning DCP gives at each call from a single process
    without a process group, a supported use here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        op(state, checkpoint_id=path)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: train.py prints the message as one line and exits."""


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _file_digests(path):
    digests = {}
    for name in sorted(os.listdir(path)):
        if name == "manifest.json":
            continue
        crc, size = 0, 0
        with open(os.path.join(path, name), "rb") as f:
            while chunk := f.read(1 << 24):
                crc, size = zlib.crc32(chunk, crc), size + len(chunk)
        digests[name] = {"bytes": size, "crc32": crc}
    return digests


def _write_atomic(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _plain(t):
    """`t` as a plain tensor (a DTensor around a plain local one). A wrapper subclass that holds one
    inner tensor of its own shape and dtype (float8 training's weights, and their optimizer state)
    gives that tensor: DCP would pickle the subclass, which a reader without its library cannot load."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    if type(local) in (torch.Tensor, torch.nn.Parameter) or not hasattr(local, "__tensor_flatten__"):
        return t
    names, _ = local.__tensor_flatten__()
    inner = getattr(local, names[0])
    if len(names) != 1 or inner.shape != local.shape or inner.dtype != local.dtype:
        raise CheckpointError(f"cannot save a {type(local).__name__} as a plain tensor: it holds {names}")
    return DTensor(inner, t._spec, requires_grad=False) if isinstance(t, DTensor) else inner


def save(out_dir, model, optimizer, meta, keep=2):
    """Write a checkpoint of model + optimizer + `meta` (a JSON-able dict with 'iter_num')."""
    final = os.path.join(out_dir, f"ckpt-{meta['iter_num']:07d}")
    tmp = final + ".tmp"
    if _rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    _dcp(dcp.save, tree_map_only(torch.Tensor, _plain, state), tmp)  # returns once every rank's shards and the metadata are written
    if os.environ.get("CHECKPOINT_TEST_CRASH") == str(_rank()):  # tests: die before the commit
        os.kill(os.getpid(), signal.SIGKILL)
    if _rank() == 0:
        # saved_at: which of two checkpoints is newer, copied or not (a resume from an older one saves
        # lower iterations after higher ones); sample.py compares an export's with it
        manifest = {"format_version": FORMAT_VERSION, **meta, "saved_at": time.time(), "files": _file_digests(tmp)}
        _write_atomic(os.path.join(tmp, "manifest.json"), json.dumps(manifest, indent=1))
        if os.path.exists(final):  # the same iteration saved again: keep the old one until replaced
            shutil.rmtree(final + ".old", ignore_errors=True)
            os.rename(final, final + ".old")
        os.rename(tmp, final)
        _write_atomic(os.path.join(out_dir, "latest"), os.path.basename(final))
        shutil.rmtree(final + ".old", ignore_errors=True)
        _prune(out_dir, keep=os.path.basename(final), count=keep)
    _barrier()


def _stored_manifest(out_dir, name):
    """The manifest of checkpoint directory `name` as it is, unchecked ({} where unreadable)."""
    try:
        with open(os.path.join(out_dir, name, "manifest.json")) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _by_save_time(out_dir):
    """The checkpoint directories in out_dir, the one saved last at the end: after a resume from
    an older checkpoint, higher iteration numbers may be older. By the time the manifest records (a
    copy of the folder keeps it, where it renews the files' times), else by the manifest file's."""
    def saved_at(name):
        recorded = _stored_manifest(out_dir, name).get("saved_at")
        if isinstance(recorded, (int, float)):
            return recorded
        manifest = os.path.join(out_dir, name, "manifest.json")
        return os.path.getmtime(manifest) if os.path.exists(manifest) else 0.0
    return sorted(_checkpoint_dirs(out_dir)[0], key=saved_at)


def _checkpoint_dirs(out_dir):
    """(checkpoints, leftovers) among out_dir's directories. A save cut short by a crash leaves a
    `.tmp`, never loadable, and a re-save of an iteration sets the one it replaces aside as `.old`:
    that iteration's checkpoint if the re-save never took its name (latest_path resumes it), else a
    leftover too."""
    names = {d for d in os.listdir(out_dir) if os.path.isdir(os.path.join(out_dir, d))}
    checkpoints, leftovers = [], []
    for d in names:
        base, _, suffix = d.partition(".")
        if NAME.fullmatch(base) and suffix in ("", "old", "tmp"):
            (checkpoints if suffix == "" or suffix == "old" and base not in names else leftovers).append(d)
    return checkpoints, leftovers


def _prune(out_dir, keep, count):
    """Keep checkpoint `keep` (just saved) and the count-1 others saved last; remove the leftovers
    of crashed saves, which would otherwise stay until their iteration is saved again."""
    others = [d for d in _by_save_time(out_dir) if d != keep]
    for old in others[:max(0, len(others) - (count - 1))]:
        shutil.rmtree(os.path.join(out_dir, old))
    for name in _checkpoint_dirs(out_dir)[1]:
        shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)


def holds_checkpoints(out_dir):
    """Whether out_dir has a `latest` pointer or any checkpoint directory."""
    if os.path.exists(os.path.join(out_dir, "latest")):
        return True
    return os.path.isdir(out_dir) and bool(_by_save_time(out_dir))


def saved_by(out_dir, job):
    """Whether a checkpoint in out_dir was saved by torchrun job `job` (train.py's torchrun_job())."""
    return any(_stored_manifest(out_dir, name).get("job") == job for name in _by_save_time(out_dir))


def export_path(out_dir):
    return os.path.join(out_dir, EXPORT)


def latest_path(out_dir):
    pointer = os.path.join(out_dir, "latest")
    if not os.path.exists(pointer):
        export = f"; its {EXPORT} is an export of the model alone, which does not resume" \
            if os.path.exists(export_path(out_dir)) else ""
        raise CheckpointError(f"no checkpoint in {out_dir} (no '{pointer}'{export})")
    try:
        with open(pointer) as f:
            name = f.read().strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{pointer} is corrupt (not a checkpoint's name)")
    if not name:
        raise CheckpointError(f"{pointer} is empty")
    path = os.path.join(out_dir, name)
    # a crash while replacing a checkpoint of the same iteration leaves the previous one as .old
    path = path if os.path.exists(path) or not os.path.exists(path + ".old") else path + ".old"
    if not os.path.isdir(path):
        raise CheckpointError(f"{pointer} names {name}, which is not in {out_dir}")
    return path


def read_manifest(path, verify=True):
    """The manifest of checkpoint directory `path`, after checking it is complete and intact."""
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete (no manifest.json)")
    except (json.JSONDecodeError, UnicodeDecodeError, IsADirectoryError):
        raise CheckpointError(f"checkpoint {path} has a corrupt manifest.json")
    if not isinstance(manifest, dict):
        raise CheckpointError(f"checkpoint {path} has a corrupt manifest.json (not a JSON object)")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {version}; this code reads {FORMAT_VERSION}")
    for key, kind in MANIFEST_FIELDS.items():
        if not isinstance(manifest.get(key), kind):
            raise CheckpointError(f"checkpoint {path} has a corrupt manifest.json ('{key}' is missing or of "
                                  "the wrong type)")
    if not all(isinstance(d, dict) and d.keys() == {"bytes", "crc32"} for d in manifest["files"].values()):
        raise CheckpointError(f"checkpoint {path} has a corrupt manifest.json (a 'files' entry is not "
                              "{'bytes': ..., 'crc32': ...})")
    missing = MODEL_ARGS - manifest["model_args"].keys()
    if missing:
        raise CheckpointError(f"checkpoint {path} has a corrupt manifest.json ('model_args' lacks "
                              f"{', '.join(sorted(missing))})")
    if verify:
        found = _file_digests(path)
        for name, want in manifest["files"].items():
            got = found.get(name)
            if got is None:
                raise CheckpointError(f"checkpoint {path} is missing {name}")
            if got != want:
                raise CheckpointError(f"checkpoint {path} is corrupt: {name} has {got['bytes']} bytes, "
                                      f"crc32 {got['crc32']}; expected {want['bytes']} bytes, crc32 {want['crc32']}")
    return manifest


def load_manifest(out_dir):
    """Rank 0 finds and verifies the latest checkpoint; every rank gets (path, manifest) or the error."""
    result = [None]
    if _rank() == 0:
        path = None
        try:
            path = latest_path(out_dir)
            result[0] = (path, read_manifest(path))
        except (CheckpointError, OSError) as e:  # (an unreadable file: a traceback would leave the others waiting)
            if isinstance(e, OSError):
                e = CheckpointError(f"cannot read the checkpoint in {out_dir}: {e}")
            intact = _intact_other(out_dir, path)  # named, not taken: a silent fallback would hide the damage
            result[0] = CheckpointError(f"{e}; {intact} is intact: write '{os.path.basename(intact)}' into "
                                        f"{os.path.join(out_dir, 'latest')} to use it") if intact else e
    if dist.is_initialized():
        dist.broadcast_object_list(result, src=0)
    if isinstance(result[0], CheckpointError):
        raise result[0]
    return result[0]


def _intact_other(out_dir, damaged):
    """The checkpoint saved last in out_dir other than `damaged`, if it verifies; else None. (Only
    that one: the other ranks wait while rank 0 reads it, as for the latest.)"""
    others = [d for d in _by_save_time(out_dir) if os.path.join(out_dir, d) != damaged] \
        if os.path.isdir(out_dir) else []
    if not others:
        return None
    path = os.path.join(out_dir, others[-1])
    try:
        read_manifest(path)
    except (CheckpointError, OSError):
        return None
    return path


def load(path, model, optimizer):
    """Load model and optimizer state (any backend, any world size) in place. The optimizer keeps
    this run's settings (weight decay, betas: a resume may change them); its state (moments, step
    counts) is the checkpoint's."""
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    with _load_errors(path):
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        _dcp(dcp.load, state, path)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
    for group, mine in zip(optimizer.param_groups, settings):
        group.update(mine)


def load_model_only(path, model):
    """Load just the model weights into a plain (unsharded, single-process) model."""
    with _load_errors(path):
        state = {"model": get_model_state_dict(model)}
        _dcp(dcp.load, state, path)
        set_model_state_dict(model, state["model"])


@contextmanager
def _load_errors(path):
    """Whatever a load raises becomes a one-line CheckpointError: a shape that does not match, a file
    DCP cannot parse. DCP reports those as a CheckpointException, a BaseException (which `except
    Exception` misses) holding each failed rank's error and traceback: the lowest rank's is named."""
    try:
        yield
    except (Exception, dcp.CheckpointException) as e:
        error = e.failures[min(e.failures)][0] if isinstance(e, dcp.CheckpointException) and e.failures else e
        message = str(error).strip().splitlines()
        raise CheckpointError(f"cannot load checkpoint {path}: {type(error).__name__}"
                              + (f": {message[0]}" if message else "")) from None


if __name__ == "__main__":
    import configurator
    from model import GPT, GPTConfig
    parser = configurator.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir", metavar="OUT_DIR",
                        help=f"a run's folder: its latest checkpoint is written to OUT_DIR/{EXPORT}")
    out_dir = parser.parse_args().out_dir
    try:
        ckpt, manifest = load_manifest(out_dir)
        gpt = GPT(GPTConfig(**manifest["model_args"]))
        load_model_only(ckpt, gpt)
    except CheckpointError as e:
        configurator.fail(str(e))
    out = export_path(out_dir)
    torch.save({"model": gpt.state_dict(), "model_args": manifest["model_args"],
                "iter_num": manifest["iter_num"], "best_val_loss": manifest["best_val_loss"],
                "config": manifest["config"], "saved_at": manifest.get("saved_at")}, out)
    print(f"wrote {out} (iteration {manifest['iter_num']})")
