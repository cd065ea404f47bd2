"""
A W-rank job on one machine as W fake hosts: one torchrun per rank, each with an NCCL_HOSTID of its
own. NCCL refuses two ranks on one GPU of one host; ranks that believe they are on different hosts
share it, over sockets on the loopback interface. Each rank is local rank 0, on cuda:0. On CPU (gloo)
NCCL_HOSTID goes unused and the job is an ordinary multi-process one.

Rehearsal of a cluster run on one GPU: numbers and memory, not speed (the ranks time-share the GPU):

    python scripts/fakehosts.py --nproc=4 train.py config/train_shakespeare_char.py --dist_backend=custom_fsdp

For train.py it first plans each rank's peak memory (plan.py) and refuses, in one line, W ranks
that cannot fit in the GPU's memory; after the run it prints each rank's peak memory from
out_dir/metrics.jsonl. Any other script is launched as it is. Fake hosts' own flags (--nproc,
--timeout) come before the script. Every process started is stopped at the end, on success,
failure (one rank fails: the others are stopped, the exit code is that rank's) and timeout alike.

As a module: launch(nproc, script, args, timeout=...) -> Result (the tests use it).
"""
import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # (the rehearsal reads train.py's settings with its configurator, and builds its model)
import configurator  # noqa: E402
GRACE_S = 10  # after SIGTERM, what is left is SIGKILLed
MARKER = "FAKEHOSTS_LAUNCH"  # environment variable naming the launch each process belongs to
PORTS = range(22000, 30000)  # below the kernel's ephemeral range, which outgoing connections draw from
_ports_given, _ports_lock = set(), threading.Lock()

BYTES_PER_PARAM = 16  # fp32 parameter, gradient and AdamW's two moments
GiB, MiB = 2**30, 2**20


class Result(NamedTuple):
    returncode: int  # 0; a failed rank's exit code; 124 on timeout
    outputs: list  # each fake host's stdout and stderr, interleaved as written
    pids: list  # the hosts and every process of theirs still running at the end (all stopped)
    timed_out: bool

    def describe(self):
        tails = "".join(f"--- host {i} ---\n{out[-4000:]}\n" for i, out in enumerate(self.outputs))
        return f"exit {self.returncode}{' (timed out)' if self.timed_out else ''}\n{tails}"


def free_port():
    """A port nothing listens on, not handed out before by this process (concurrent launches)."""
    with _ports_lock:
        for port in random.sample(PORTS, len(PORTS)):
            if port in _ports_given:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _ports_given.add(port)
            return port
    raise RuntimeError(f"no free port in {PORTS.start}..{PORTS.stop - 1}")


def host_command(nproc, rank, port, script, args):
    """torchrun for fake host `rank`: one process, static rendezvous at 127.0.0.1:port."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nproc}", "--nproc_per_node=1",
            f"--node_rank={rank}", "--master_addr=127.0.0.1", f"--master_port={port}", "--max_restarts=0",
            "--monitor_interval=0.5", str(script), *map(str, args)]


def host_env(rank, marker, env=None):
    """The environment of fake host `rank`: its own NCCL host id; NCCL bootstraps and talks over lo;
    the launch's marker, by which stop() finds every process the host starts."""
    env = dict(os.environ if env is None else env)
    env.setdefault("NCCL_IB_DISABLE", "1")  # (sockets on lo: an InfiniBand adapter would loop back through the NIC)
    return env | {"NCCL_HOSTID": f"fakehost{rank}", "NCCL_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1",
                  MARKER: marker}


def marked(marker):
    """{pid: process group} of the living processes whose environment carries this launch's marker.
    The marker is inherited by everything a host starts, however deep, whatever session it is in
    (torchrun starts each worker in a session of its own) and whether or not its parent lives."""
    needle, found = f"{MARKER}={marker}".encode(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # (exited meanwhile, or another user's)
            continue
        state, _, pgid = stat.rsplit(")", 1)[1].split()[:3]
        if needle in environ.split(b"\0") and state not in "ZX":  # (a zombie only waits to be reaped)
            found[int(entry)] = int(pgid)
    return found


def stop(hosts, marker):
    """SIGTERM the process group of every process of the launch (torchrun passes it on to its workers
    too), then SIGKILL what still lives after GRACE_S; reap the hosts. Returns the pids it found."""
    seen = set()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        found = marked(marker) | {h.pid: h.pid for h in hosts if h.poll() is None}
        seen |= set(found)
        for group in set(found.values()) - {os.getpgrp()}:
            try:
                os.killpg(group, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and (marked(marker) or any(h.poll() is None for h in hosts)):
            time.sleep(0.1)
        if not marked(marker):
            break
    for h in hosts:
        h.wait()
    return seen


def worker_exit_code(output, host_code):
    """The failed worker's own exit code from torchrun's failure report ('exitcode : 2 (pid: ...)'),
    or else the host's; killed by a signal reads as 128 + it, as in a shell."""
    found = re.findall(r"exitcode\s*:\s*(-?\d+)", output)
    code = int(found[0]) if found else host_code
    return 128 - code if code < 0 else code


def launch(nproc, script, args=(), timeout=600, env=None, cwd=None, stream=None):
    """Run `script args` as `nproc` fake hosts and wait for them all, or for the first to fail, or
    for `timeout` seconds; stop everything started in every case. `stream`: a file each output line
    also goes to, prefixed with its host's rank."""
    port, marker = free_port(), uuid.uuid4().hex
    hosts, outputs, readers, lock = [], [], [], threading.Lock()

    def read(rank, pipe):
        for line in pipe:
            outputs[rank].append(line)
            if stream is not None:
                with lock:
                    stream.write(f"[{rank}] {line}")
                    stream.flush()

    failed, timed_out, seen = None, False, set()
    try:
        for rank in range(nproc):
            hosts.append(subprocess.Popen(host_command(nproc, rank, port, script, args), cwd=cwd,
                                          env=host_env(rank, marker, env), stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, errors="replace",
                                          start_new_session=True))
            outputs.append([])
            readers.append(threading.Thread(target=read, args=(rank, hosts[-1].stdout), daemon=True))
            readers[-1].start()
        deadline = time.monotonic() + timeout
        while True:
            codes = [h.poll() for h in hosts]
            failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None or None not in codes:
                break
            if time.monotonic() >= deadline:
                timed_out = True
                break
            time.sleep(0.1)
    finally:
        seen = stop(hosts, marker)
    for r in readers:
        r.join(GRACE_S)
    texts = ["".join(lines) for lines in outputs]
    if timed_out:
        code = 124
    elif failed is not None:
        code = worker_exit_code(texts[failed], hosts[failed].returncode)
    else:
        code = 0
    return Result(code, texts, sorted({h.pid for h in hosts} | seen), timed_out)


# ---- the rehearsal of train.py ------------------------------------------------------------------

def parameter_count(settings):
    """Parameters of the model the settings describe, built on the meta device (no memory), with
    the vocabulary train.py takes."""
    import torch
    import training
    from model import GPT, GPTConfig
    vocab = training.vocab_size(settings)
    shape = {k: settings[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "bias")}
    with torch.device("meta"):
        model = GPT(GPTConfig(**shape, vocab_size=vocab))
    return sum(p.numel() for p in model.parameters())


def state_bytes_per_rank(settings, nproc, params):
    """Model state a rank holds on the GPU: all of it under ddp, 1/shard-group-size of it under the
    sharded backends (HSDP's replicas each hold a whole copy), none offloaded to CPU memory."""
    if settings["dist_backend"] == "ddp":
        return BYTES_PER_PARAM * params
    if settings["cpu_offload"]:
        return 0
    return BYTES_PER_PARAM * params / max(nproc // settings["replicate_degree"], 1)


def planned(train_args, nproc):
    """plan.py's row for train.py's run at nproc ranks: rank 0's, whose shards are the largest
    (under cpu_offload, the GPU's side)."""
    import planner
    import training
    settings = training.settings(train_args)
    settings["vocab_size"] = training.vocab_size(settings)
    return planner.in_child(planner.plan, settings, settings["dist_backend"], nproc, 0)


def process_bytes(row):
    """A rank's planned GPU memory: what PyTorch's allocator reserves, and the CUDA context and
    NCCL's buffers beside it."""
    return row["reserved_bytes"] + row["outside_allocator_bytes"]


def memory_refusal(settings, nproc, gpu_bytes, row):
    """Why `nproc` ranks cannot share a GPU of gpu_bytes (one line), or None."""
    per_rank = process_bytes(row)
    if nproc * per_rank <= gpu_bytes:
        return None
    ddp = settings["dist_backend"] == "ddp"
    return (f"{nproc} ranks of {settings['dist_backend']} need at least {nproc} x {per_rank / GiB:.1f} GiB "
            f"(plan.py: {row['reserved_bytes'] / GiB:.1f} GiB reserved, {row['outside_allocator_bytes'] / GiB:.1f} GiB "
            f"of CUDA context and NCCL buffers) = {nproc * per_rank / GiB:.1f} GiB, "
            f"more than the GPU's {gpu_bytes / GiB:.1f} GiB: use fewer ranks{' or a sharded backend' if ddp else ''}")


def last_run_memory_rows(out_dir):
    """The memory rows the last run wrote to out_dir/metrics.jsonl: those after its last step's or
    evaluation's row (a resumed run appends to the rows of the runs before it)."""
    path = Path(out_dir) / "metrics.jsonl"
    if not path.exists():  # (eval_only=True writes eval.jsonl)
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    last_iter = max((i for i, r in enumerate(rows) if "iter" in r), default=-1)
    return [r for r in rows[last_iter + 1:] if r.get("event") == "memory"]


def memory_report(rows, nproc, state_estimate, gpu_bytes=None):
    """Lines on each rank's memory (rows are max over ranks) against the estimate and the GPU."""
    if not rows:
        return []
    peak = {k: max((r.get(k, 0.0) for r in rows), default=0.0) for k in ("max_allocated_mb", "reserved_mb", "rss_mb")}
    state = max((r["params_mb"] + r["grads_mb"] + r["optim_mb"] for r in rows), default=0.0)
    where = (f"peak allocated {peak['max_allocated_mb']:,.0f} MiB, reserved {peak['reserved_mb']:,.0f} MiB"
             if gpu_bytes else f"peak RSS {peak['rss_mb']:,.0f} MiB")
    lines = [f"memory per rank (max over ranks): {where}; model state {state:,.1f} MiB "
             f"(estimated {state_estimate / MiB:,.1f} MiB)"]
    if gpu_bytes:
        total = nproc * peak["reserved_mb"] * MiB
        lines.append(f"{nproc} ranks x {peak['reserved_mb']:,.0f} MiB reserved = {total / GiB:.1f} GiB of the "
                     f"GPU's {gpu_bytes / GiB:.1f} GiB ({total / gpu_bytes:.0%}; CUDA contexts not counted)")
    return lines


def main(argv=None):
    parser = configurator.ArgumentParser(description=__doc__)
    parser.add_argument("--nproc", type=int, required=True, help="ranks, one fake host each (required)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before everything is stopped")
    parser.add_argument("script", help="the script each rank runs (train.py: planned and rehearsed)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    a = parser.parse_args(argv)
    if a.nproc < 1:
        parser.error(f"--nproc={a.nproc} must be at least 1")
    if not Path(a.script).is_file():
        configurator.fail(f"no script {a.script}")
    rehearsal = Path(a.script).name == "train.py"
    if rehearsal:
        import training
        settings = training.settings(a.args)
        configurator.check_device(settings["device"])
        params = parameter_count(settings)
        estimate = state_bytes_per_rank(settings, a.nproc, params)
        gpu_bytes = None
        if settings["device"].startswith("cuda"):
            import torch
            gpu_bytes = torch.cuda.get_device_properties(0).total_memory
            from backends import BackendError
            try:
                row = planned(a.args, a.nproc)
            except BackendError as e:  # (what train.py would refuse: ddp with cpu_offload, say)
                configurator.fail(str(e))
            refusal = memory_refusal(settings, a.nproc, gpu_bytes, row)
            if refusal:
                configurator.fail(refusal)
        print(f"fakehosts: {a.nproc} ranks of {settings['dist_backend']} on one {settings['device'].split(':')[0]}"
              f"{f' ({gpu_bytes / GiB:.1f} GiB)' if gpu_bytes else ''}; {params:,} parameters, "
              f"model state about {estimate / MiB:,.1f} MiB per rank", flush=True)
    # our own SIGTERM stops the hosts too (launch's cleanup runs on the way out)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    res = launch(a.nproc, a.script, a.args, timeout=a.timeout, stream=sys.stdout)
    if res.timed_out:
        print(f"error: timed out after {a.timeout:g}s: every fake host stopped", file=sys.stderr, flush=True)
        sys.exit(124)
    if rehearsal and res.returncode == 0:
        rows = last_run_memory_rows(settings["out_dir"])
        for line in memory_report(rows, a.nproc, estimate, gpu_bytes):
            print(f"fakehosts: {line}")
    sys.exit(res.returncode)


if __name__ == "__main__":
    main()
