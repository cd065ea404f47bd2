"""
scripts/fakehosts.py on the CPU (gloo): train.py as two fake hosts computes the same numbers as under
tests/spawn.py; a launch leaves no process behind, whether it succeeds, one rank fails or it times
out; the rehearsal refuses ranks that a GPU's memory cannot hold. The launches run at once (one
module fixture), since each spends most of its time starting torchrun.
"""
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import REPO, launch, losses, run_train, subprocess_env

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
import fakehosts  # noqa: E402
import training  # noqa: E402

TRAIN = ["--dist_backend=custom_fsdp", "--gradient_accumulation_steps=2", "--max_iters=3", "--eval_interval=100",
         "--keep_checkpoints=0"]
TIMEOUT_S = 25  # the timed-out launch's: long enough for its workers to start on a loaded CI machine

# each rank records its pid and the pid of a child it starts in a session of its own (as torchrun
# starts its workers: out of reach of its parent's process group), then sleeps; with `fail`, rank 1
# exits 3 once both ranks have recorded theirs
SLEEPER = textwrap.dedent("""
    import os, subprocess, sys, time
    from pathlib import Path
    where, mode, rank = Path(sys.argv[1]), sys.argv[2], os.environ["RANK"]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    (where / f"{rank}-{os.getpid()}-{child.pid}").touch()
    while mode == "fail" and rank == "1":
        if len(list(where.iterdir())) == 2:
            sys.exit(3)
        time.sleep(0.1)
    time.sleep(600)
""")


def sleepers(tmp, mode, timeout):
    """fakehosts.launch of SLEEPER at W=2; returns (Result, the pids its workers recorded)."""
    where = tmp / mode
    where.mkdir()
    script = tmp / f"sleeper_{mode}.py"  # (one each: the launches run at once)
    script.write_text(SLEEPER)
    res = fakehosts.launch(2, script, [where, mode], timeout=timeout, env=subprocess_env())
    return res, [int(pid) for f in where.iterdir() for pid in f.name.split("-")[1:]]


@pytest.fixture(scope="module")
def launches(tiny_args, tmp_path_factory):
    """The same train.py run through the fakehosts CLI and under tests/spawn.py, a launch whose rank 1
    fails and one that times out: all at once."""
    tmp = tmp_path_factory.mktemp("fakehosts")
    fake_cmd = [sys.executable, REPO / "scripts" / "fakehosts.py", "--nproc=2", REPO / "train.py",
                f"--out_dir={tmp / 'fake'}", "--device=cpu", *tiny_args, *TRAIN]
    with ThreadPoolExecutor(5) as pool:
        jobs = {"fake": pool.submit(launch, fake_cmd, 300),
                "spawn": pool.submit(run_train, tmp / "spawn", 2, *tiny_args, *TRAIN),
                "fail": pool.submit(sleepers, tmp, "fail", 300),
                "timeout": pool.submit(sleepers, tmp, "timeout", TIMEOUT_S)}
        return {name: job.result() for name, job in jobs.items()} | {"tmp": tmp}


def test_fake_hosts_train_as_spawned_ranks_do(launches):
    """Two fake hosts (one torchrun each, static rendezvous) train bit for bit as two ranks of one
    host do: same data, same gloo, same sums. The CLI also reports each rank's memory."""
    for name in ("fake", "spawn"):
        assert launches[name].returncode == 0, launches[name].describe()
    fake, spawned = launches["tmp"] / "fake", launches["tmp"] / "spawn"
    assert sorted(losses(fake)) == [0, 1, 2]
    assert losses(fake) == losses(spawned)
    assert losses(fake, "grad_norm") == losses(spawned, "grad_norm")
    out = launches["fake"].stdout
    assert "[0] custom_fsdp on 2 process(es)" in out, out
    assert "fakehosts: memory per rank (max over ranks): peak RSS" in out, out


def running(pids):
    """Those of `pids` that run (a zombie only waits to be reaped)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in "ZX":
            alive.append(pid)
    return alive


def test_one_rank_failing_stops_every_process(launches):
    """Rank 1 exits 3: the launch exits 3 and no process it started (hosts, workers, the workers'
    children in sessions of their own) is left."""
    res, pids = launches["fail"]
    assert res.returncode == 3 and not res.timed_out, res.describe()
    assert len(pids) == 4, res.describe()  # two workers and their children
    assert not running(pids + res.pids), (pids, res.pids, running(pids + res.pids))


def test_timeout_stops_every_process(launches):
    res, pids = launches["timeout"]
    assert res.timed_out and res.returncode == 124, res.describe()
    assert len(pids) == 4, f"the workers had not started within {TIMEOUT_S}s\n{res.describe()}"
    assert not running(pids + res.pids), (pids, res.pids, running(pids + res.pids))


def test_rehearsal_refuses_ranks_the_gpu_cannot_hold(tmp_path):
    """The rehearsal asks plan.py for a rank's GPU memory (its reserve, CUDA context and NCCL
    buffers): 4 ranks are refused by a GPU one byte short of holding them all, and fit one that
    does. The plan is of the run asked for: ddp's peak is above a sharded backend's, and that above
    its GPU side under cpu_offload."""
    config = tmp_path / "small.py"
    config.write_text("n_layer = 2\nn_head = 4\nn_embd = 128\nblock_size = 128\nbatch_size = 4\n")
    args = [str(config), f"--data_dir={tmp_path}", "--device=cuda", "--max_iters=3"]
    settings = training.settings(args)
    assert settings["n_layer"] == 2 and settings["device"] == "cuda" and settings["dist_backend"] == "ddp"
    params = fakehosts.parameter_count(settings)
    row = fakehosts.planned(args, 4)
    assert row["peak_allocated_bytes"] > fakehosts.state_bytes_per_rank(settings, 4, params)  # activations too
    assert fakehosts.process_bytes(row) > row["reserved_bytes"] >= row["peak_allocated_bytes"]
    need = 4 * fakehosts.process_bytes(row)
    msg = fakehosts.memory_refusal(settings, 4, need - 1, row)
    assert msg and "\n" not in msg and msg.startswith("4 ranks of ddp need at least"), msg
    assert "plan.py" in msg and "sharded backend" in msg, msg
    assert fakehosts.memory_refusal(settings, 4, need, row) is None
    sharded = fakehosts.planned(args + ["--dist_backend=fsdp"], 4)["peak_allocated_bytes"]
    assert sharded < row["peak_allocated_bytes"]
    # under cpu_offload the plan is the GPU's side: the state lives in host memory
    assert fakehosts.planned(args + ["--dist_backend=fsdp", "--cpu_offload=True"], 4)["peak_allocated_bytes"] < sharded


def test_cli_bad_input_is_one_line():
    for args, words in ((["--nproc=0", "train.py"], "--nproc=0"), (["train.py"], "--nproc"),
                        (["--nproc=2", "no_such.py"], "no script")):
        res = launch([sys.executable, REPO / "scripts" / "fakehosts.py", *args], timeout=60)
        lines = res.stderr.splitlines()
        assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], \
            res.describe()
