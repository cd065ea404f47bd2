"""Beyond one launcher and through failures: two torchrun "nodes" on one machine, a rank killed
mid-training and mid-save, elastic restart, checkpoint rotation, non-finite losses, and the
bad-input cases of resuming. Every process started here is killed on the way out."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, free_port, launch, launcher, load_metrics, losses, one_error_line, run_train, start


def finish(proc, timeout):
    """Wait for a started launcher; on timeout kill its process group and fail."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"did not finish within {timeout}s\n{err[-4000:]}")
    return proc.returncode, out, err


def children(pid):
    """PIDs whose parent is `pid` (torchrun's workers)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def ended(pid):
    """Whether process `pid` has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


def wait_for_checkpoint(out_dir, proc, timeout=120):
    deadline = time.time() + timeout
    while not (Path(out_dir) / "latest").exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def args(tiny_args):
    return [*tiny_args, "--gradient_accumulation_steps=4", "--eval_interval=4", "--max_iters=12"]


def trained(tmp_path_factory, name, nproc, *args):
    """The out_dir of a custom_fsdp run that must succeed: a module fixture's reference."""
    out = tmp_path_factory.mktemp(name)
    res = run_train(out, nproc, *args, "--dist_backend=custom_fsdp")
    assert res.returncode == 0, res.describe()
    return out


@pytest.fixture(scope="module")
def unbroken(args, tmp_path_factory):
    """The reference: custom_fsdp at world size 2, 12 iterations without a failure."""
    return losses(trained(tmp_path_factory, "unbroken", 2, *args))


@pytest.fixture(scope="module")
def one_node_w4(args, tmp_path_factory):
    """custom_fsdp at world size 4 from one launcher, 4 iterations: what the multi-node runs match."""
    return trained(tmp_path_factory, "one_node_w4", 4, *args, "--max_iters=4")


def test_two_launchers_as_two_nodes_match_one_launcher(args, one_node_w4, tmp_path):
    """(custom_fsdp only: FSDP2's run across launchers is torchrun's and PyTorch's to test.)"""
    port = free_port()
    nodes = []
    for node_rank in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
               f"--node_rank={node_rank}", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
               REPO / "train.py", f"--out_dir={tmp_path / 'multi'}", "--device=cpu", *args,
               "--max_iters=4", "--dist_backend=custom_fsdp"]
        nodes.append(start(cmd))
    for proc in nodes:
        code, _, err = finish(proc, 300)
        assert code == 0, err[-4000:]
    # same world size, same global ranks: the same arithmetic, so the same bits
    assert losses(tmp_path / "multi") == losses(one_node_w4)


def test_hsdp_across_nodes_matches_plain_fsdp(args, one_node_w4, tmp_path):
    """replicate_degree=2 at world size 4: shard inside each "node", all-reduce across them.
    AVG over 2 then over 2 is not the same rounding as AVG over 4: equal to 1e-6, not bitwise."""
    res = run_train(tmp_path / "hsdp", 4, *args, "--max_iters=4", "--dist_backend=custom_fsdp", "--replicate_degree=2")
    assert res.returncode == 0, res.describe()
    hsdp, fsdp = losses(tmp_path / "hsdp"), losses(one_node_w4)
    assert hsdp.keys() == fsdp.keys()
    assert max(abs(hsdp[i] - fsdp[i]) for i in hsdp) <= 1e-6
    # the norm sums the squared shard norms inside a replica only (the replicas hold the same shards)
    hsdp, fsdp = losses(tmp_path / "hsdp", "grad_norm"), losses(one_node_w4, "grad_norm")
    assert max(abs(hsdp[i] - fsdp[i]) / fsdp[i] for i in hsdp) <= 1e-6


# run as torchrun's script before train.py: rank 1 SIGKILLs itself as the first checkpoint is
# committed (checkpoint.save returns after `latest` is written), on the job's first attempt only.
# The fault fires where it should, not in a race with a test polling for the checkpoint.
KILL_RANK_1_AFTER_FIRST_SAVE = """
import os, runpy, signal, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import checkpoint
save = checkpoint.save
def save_then_die(*args, **kwargs):
    save(*args, **kwargs)
    if os.environ["RANK"] == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint.save = save_then_die
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def killing_rank_1_after_first_save(tmp_path):
    """The script that runs train.py (its next argument) with KILL_RANK_1_AFTER_FIRST_SAVE."""
    script = tmp_path / "kill_rank_1_after_first_save.py"
    script.write_text(KILL_RANK_1_AFTER_FIRST_SAVE)
    return script


def test_sigkill_mid_training_stops_the_job_and_resume_is_exact(args, unbroken, tmp_path):
    out = tmp_path / "out"
    cmd = launcher(2, torchrun=True) + [killing_rank_1_after_first_save(tmp_path), REPO / "train.py",
                                        f"--out_dir={out}", "--device=cpu", *args, "--dist_backend=custom_fsdp"]
    code, _, err = finish(start(cmd), 120)
    killed_at = (out / "latest").stat().st_mtime
    assert code != 0 and time.time() - killed_at < 60, err[-4000:]  # torchrun tears the other rank down: no hang
    assert (out / "latest").read_text() == "ckpt-0000004"
    res = run_train(out, 2, *args, "--dist_backend=custom_fsdp", "--init_from=resume")
    assert res.returncode == 0, res.describe()
    resumed = losses(out)
    assert all(resumed[i] == unbroken[i] for i in range(4, 12)), (resumed, unbroken)


def test_a_hung_rank_times_out_instead_of_hanging_the_job(args, tmp_path):
    """A rank that stops answering (SIGSTOP: alive, silent): the other one's next collective gives
    up after dist_timeout_s and the job ends, instead of waiting forever. Launched by tests/spawn.py,
    whose children are the ranks themselves (torchrun's are relays: see conftest.start), so the
    ranks start at once and a short timeout holds the start too."""
    cmd = launcher(2) + [REPO / "train.py", f"--out_dir={tmp_path}", "--device=cpu", *args,
                         "--dist_backend=custom_fsdp", "--max_iters=1000000", "--dist_timeout_s=5"]
    proc = start(cmd)
    try:
        wait_for_checkpoint(tmp_path, proc)
        healthy, hung = children(proc.pid)  # (either rank: the other one times out)
        os.kill(hung, signal.SIGSTOP)
        t0 = time.time()
        while not ended(healthy):
            assert time.time() - t0 < 60, "the healthy rank did not give up"
            time.sleep(0.2)
        # the launcher has sent the stopped rank SIGTERM, which it would SIGKILL after a 30 s grace
        # period: let it take the signal now
        os.kill(hung, signal.SIGCONT)
        code, _, err = finish(proc, 60)
        assert code != 0, err[-4000:]
        assert "timed out" in err.lower(), err[-4000:]  # (gloo's "Timed out")
    finally:
        for pid in [proc.pid, *children(proc.pid)]:  # on a failed assert: leave nothing stopped behind
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_sigkill_mid_save_keeps_the_previous_checkpoint(args, unbroken, saved, tmp_path):
    """Rank 0 (which commits) dies after the shards of iteration 8 are written, before the commit."""
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)  # custom_fsdp at W=2 to iteration 4
    cmd = launcher(2, torchrun=True) + [REPO / "train.py", f"--out_dir={tmp_path}", "--device=cpu", *args,
                         "--dist_backend=custom_fsdp", "--init_from=resume", "--max_iters=8"]
    t0 = time.time()
    code, _, _ = finish(start(cmd, env={"CHECKPOINT_TEST_CRASH": "0"}), 120)
    assert code != 0 and time.time() - t0 < 90
    assert (tmp_path / "latest").read_text() == "ckpt-0000004"
    assert (tmp_path / "ckpt-0000008.tmp").exists() and not (tmp_path / "ckpt-0000008").exists()
    res = run_train(tmp_path, 2, *args, "--dist_backend=custom_fsdp", "--init_from=resume")
    assert res.returncode == 0, res.describe()
    resumed = losses(tmp_path)
    assert all(resumed[i] == unbroken[i] for i in range(12))


@pytest.mark.parametrize("job_id", [True, False], ids=["standalone", "id_none"])
def test_elastic_restart_continues_from_the_last_checkpoint(args, unbroken, tmp_path, job_id):
    cmd = launcher(2, torchrun=True, job_id=job_id) + ["--max_restarts=1", killing_rank_1_after_first_save(tmp_path),
                                                       REPO / "train.py", f"--out_dir={tmp_path / 'out'}",
                                                       "--device=cpu", *args, "--dist_backend=custom_fsdp"]
    code, out, err = finish(start(cmd), 300)
    assert code == 0, err[-4000:]
    assert "restart 1: resuming from the last checkpoint" in out and "resumed from" in out, out
    assert losses(tmp_path / "out") == unbroken  # later rows (after the restart) win for repeated iterations


def test_keeps_the_last_k_checkpoints(args, tmp_path):
    res = run_train(tmp_path, 1, *args, "--dist_backend=custom_fsdp", "--eval_interval=2", "--max_iters=8",
                    "--keep_checkpoints=3")  # (not 2, checkpoint.save's own default)
    assert res.returncode == 0, res.describe()
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-0000004", "ckpt-0000006", "ckpt-0000008"]
    manifest = json.loads((tmp_path / "ckpt-0000008" / "manifest.json").read_text())
    assert manifest["world_size"] == 1 and manifest["dist_backend"] == "custom_fsdp"
    assert manifest["iter_num"] == 8 and manifest["model_args"]["n_layer"] == 2
    assert all(f["bytes"] > 0 for f in manifest["files"].values())


def test_nonfinite_loss_stops_naming_the_iteration_and_keeps_the_checkpoint(args, saved, tmp_path):
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)  # custom_fsdp at W=2 to iteration 4
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt-0000004").iterdir()}
    bad = ["--learning_rate=1e9", "--warmup_iters=0", "--decay_lr=False", "--grad_clip=0.0"]
    res = run_train(tmp_path, 2, *args, "--dist_backend=custom_fsdp", "--init_from=resume", *bad)
    line = one_error_line(res)
    assert "non-finite" in line and "at iteration" in line and f"the last checkpoint in {tmp_path} is untouched" in line
    assert (tmp_path / "latest").read_text() == "ckpt-0000004"
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt-0000004").iterdir()} == before
    # evaluated after every step: the first step's loss is finite, but the weights it leaves compute
    # nan, and that evaluation must not become a checkpoint (it would replace the good one)
    res = run_train(tmp_path, 2, *args, "--dist_backend=custom_fsdp", "--init_from=resume", "--eval_interval=1",
                    "--max_iters=8", *bad)
    assert "the model is not finite at iteration 5" in one_error_line(res)
    assert (tmp_path / "latest").read_text() == "ckpt-0000004"
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt-0000004").iterdir()} == before


def test_nonfinite_step_read_one_step_late_still_stops_before_the_save(tiny_args, tmp_path):
    """train.py reads a step's loss during the next step: a step that goes non-finite just before a
    checkpoint iteration must still stop the run, naming its own iteration, before that save."""
    bad = ["--learning_rate=1e9", "--warmup_iters=0", "--decay_lr=False", "--grad_clip=0.0"]
    res = run_train(tmp_path, 1, *tiny_args, "--eval_interval=2", "--max_iters=6", "--eval_iters=0", *bad)
    line = one_error_line(res)
    assert "non-finite loss nan or grad norm nan at iteration 1;" in line and "holds no checkpoint yet" in line
    assert not list(tmp_path.glob("ckpt-*")), "a checkpoint was saved after the non-finite step"
    assert [row["iter"] for row in load_metrics(tmp_path)[0]] == [0]


@pytest.mark.parametrize("on_nonfinite", ["stop", "skip"])
def test_without_evaluation_a_model_that_computes_nan_is_not_saved(tiny_args, tmp_path, on_nonfinite):
    """eval_iters=0 saves at every eval_interval with no evaluation loss to look at: the first step
    at a huge learning rate has a finite loss but leaves finite weights that compute nan, and the
    checkpoints saved from them replaced the good ones (under 'skip' the run even ended with 0)."""
    res = run_train(tmp_path, 1, *tiny_args, "--eval_iters=0", "--eval_interval=2", "--max_iters=4")
    assert res.returncode == 0, res.describe()
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt-0000004").iterdir()}
    bad = ["--learning_rate=1e9", "--warmup_iters=0", "--decay_lr=False", "--grad_clip=0.0"]
    res = run_train(tmp_path, 1, *tiny_args, "--eval_iters=0", "--eval_interval=1", "--max_iters=8",
                    "--init_from=resume", f"--on_nonfinite={on_nonfinite}", *bad)
    assert "the model is not finite at iteration 5" in one_error_line(res)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-0000002", "ckpt-0000004"]
    assert (tmp_path / "latest").read_text() == "ckpt-0000004"
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt-0000004").iterdir()} == before


# train.py with the third training micro-batch's loss made nan (evaluations run in eval mode, uncounted)
NAN_THIRD_MICRO_BATCH = """
import runpy, sys
import model
forward, calls = model.GPT.forward, [0]
def nan_once(self, idx, targets=None):
    logits, loss = forward(self, idx, targets)
    if self.training:
        calls[0] += 1
        if calls[0] == 3:
            loss = loss * float("nan")
    return logits, loss
model.GPT.forward = nan_once
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("backend", ["ddp", "custom_fsdp"])
def test_a_skipped_step_leaves_no_gradients_behind(tiny_args, tmp_path, backend):
    """One bad batch under on_nonfinite='skip': that step is skipped, and the next starts from no
    gradients (kept, the nan ones poisoned every later step until max_skipped_steps ended the run)."""
    cmd = launcher(None) + ["-c", NAN_THIRD_MICRO_BATCH, REPO / "train.py", f"--out_dir={tmp_path}", "--device=cpu",
                            *tiny_args, f"--dist_backend={backend}", "--on_nonfinite=skip", "--max_iters=6",
                            "--eval_interval=100", "--keep_checkpoints=0", "--gradient_accumulation_steps=1"]
    res = launch(cmd, timeout=120)
    assert res.returncode == 0, res.describe()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in rows if r.get("event") == "skipped_nonfinite"] == [2]
    steps = {r["iter"]: r for r in load_metrics(tmp_path)[0]}  # (the skipped step's row holds its nan)
    assert sorted(steps) == list(range(6)) and math.isnan(steps[2]["loss"])
    assert all(math.isfinite(steps[i]["loss"]) and math.isfinite(steps[i]["grad_norm"]) for i in (0, 1, 3, 4, 5)), steps


def test_skipping_nonfinite_steps_gives_up_on_a_diverged_model(args, tmp_path):
    bad = ["--learning_rate=1e9", "--warmup_iters=0", "--decay_lr=False", "--grad_clip=0.0", "--on_nonfinite=skip"]
    res = run_train(tmp_path / "eval", 1, *args, "--dist_backend=custom_fsdp", "--max_iters=3", *bad)
    assert "step skipped" in res.stdout  # iterations 1 and 2; the evaluation at 3 is nan: not saved
    assert "the model is not finite at iteration 3" in one_error_line(res)
    assert not (tmp_path / "eval" / "latest").exists()
    res = run_train(tmp_path / "in_a_row", 1, *args, "--dist_backend=custom_fsdp", "--max_iters=12",
                    "--eval_interval=100", "--max_skipped_steps=2", *bad)
    assert "3 steps in a row had a non-finite loss" in one_error_line(res)


@pytest.mark.parametrize("pointer", ["kept", "deleted"])
def test_a_new_run_refuses_an_out_dir_with_checkpoints(args, saved, tmp_path, pointer):
    """Also when `latest` is gone: the new run's first save would prune the checkpoints there."""
    out = tmp_path / "taken"
    subprocess.run(["cp", "-r", str(saved), str(out)], check=True)
    if pointer == "deleted":
        (out / "latest").unlink()
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    line = one_error_line(run_train(out, 1, *args, "--dist_backend=custom_fsdp", "--max_iters=2"))
    assert "holds another run's checkpoints" in line and "--init_from=resume" in line
    # saving none, it would still start that run's metrics.jsonl afresh
    line = one_error_line(run_train(out, 1, *args, "--dist_backend=custom_fsdp", "--max_iters=2", "--keep_checkpoints=0"))
    assert "holds another run's checkpoints" in line
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_folder_holding_only_an_export_refuses_a_new_run_and_says_the_export_does_not_resume(args, saved, tmp_path):
    """A model exported with `python checkpoint.py OUT_DIR`, its checkpoint directories removed: a new
    run there would mix its checkpoints and metrics.jsonl with the export's run; a resume cannot read an export."""
    out = tmp_path / "exported"
    subprocess.run(["cp", "-r", str(saved), str(out)], check=True)
    res = launch([sys.executable, REPO / "checkpoint.py", out], timeout=120)
    assert res.returncode == 0, res.describe()
    (out / "latest").unlink()
    for directory in out.glob("ckpt-*"):
        shutil.rmtree(directory)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert Path("ckpt.pt") in before and Path("metrics.jsonl") in before
    line = one_error_line(run_train(out, 1, *args, "--dist_backend=custom_fsdp", "--max_iters=2"))
    assert f"{out} holds another run's exported model (ckpt.pt)" in line, line
    line = one_error_line(run_train(out, 1, *args, "--dist_backend=custom_fsdp", "--init_from=resume"))
    assert "its ckpt.pt is an export of the model alone, which does not resume" in line, line
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("job_id", [True, False], ids=["standalone", "id_none"])
def test_a_restarted_new_run_still_refuses_another_runs_checkpoints(args, saved, tmp_path, job_id):
    """torchrun --max_restarts restarts a new run that was refused: the restart must not take the
    other run's checkpoints for its own (it resumed them, trained on and pruned one). Also where
    torchrun's job id is `none`, the id of every job launched without --standalone or --rdzv_id."""
    out = tmp_path / "taken"
    subprocess.run(["cp", "-r", str(saved), str(out)], check=True)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    cmd = launcher(2, torchrun=True, job_id=job_id) + ["--max_restarts=1", REPO / "train.py", f"--out_dir={out}",
                                                       "--device=cpu", *args, "--dist_backend=custom_fsdp"]
    res = launch(cmd, timeout=180)
    assert res.returncode != 0 and "resuming" not in res.stdout, res.describe()
    assert "holds another run's checkpoints" in res.stderr, res.describe()
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_restart_after_a_first_save_cut_before_its_commit_says_how_to_resume(args, saved, tmp_path):
    """The first save renamed its directory into place, then died before writing `latest`: the
    restart must not be refused as a new run into another run's out_dir, but name the checkpoint."""
    out = tmp_path / "cut"
    subprocess.run(["cp", "-r", str(saved), str(out)], check=True)
    (out / "latest").unlink()
    cmd = launcher(None) + [REPO / "train.py", f"--out_dir={out}", "--device=cpu", *args, "--dist_backend=custom_fsdp"]
    assert "holds another run's checkpoints" in one_error_line(launch(cmd, timeout=120))  # a new run by hand
    line = one_error_line(launch(cmd, timeout=120, env={"TORCHELASTIC_RESTART_COUNT": "1"}))
    assert f"{out / 'ckpt-0000004'} is intact: write 'ckpt-0000004' into {out / 'latest'}" in line, line


def test_pruning_keeps_the_checkpoints_saved_last(tmp_path):
    """Resumed from an older checkpoint, a run saves lower iteration numbers than ones already
    there: the checkpoint just saved must stay (by name it would have been the first to go). What
    a crashed save left goes."""
    sys.path.insert(0, str(REPO))
    import checkpoint
    for age, name in enumerate(["ckpt-0000004", "ckpt-0000008", "ckpt-0000006"]):  # in save order
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
        os.utime(tmp_path / name / "manifest.json", (1000 + age, 1000 + age))
    (tmp_path / "ckpt-0000010.tmp").mkdir()  # a save a crash cut short
    (tmp_path / "ckpt-0000010.tmp" / "__0_0.distcp").write_text("")
    checkpoint._prune(str(tmp_path), keep="ckpt-0000006", count=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000006", "ckpt-0000008"]
    checkpoint._prune(str(tmp_path), keep="ckpt-0000006", count=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000006"]
    # the save time a manifest records wins over its file's, which a copy of the folder renews
    for age, name in enumerate(["ckpt-0000004", "ckpt-0000008"]):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(json.dumps({"saved_at": 2000 + age}))
        os.utime(tmp_path / name / "manifest.json", (3000 - age, 3000 - age))
    checkpoint._prune(str(tmp_path), keep="ckpt-0000006", count=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000006", "ckpt-0000008"]


@pytest.mark.parametrize("setting,named", [
    (["--gradient_accumulation_steps=0"], "gradient_accumulation_steps=0 must be at least 1"),
    (["--eval_interval=0"], "eval_interval=0 must be at least 1"),
    (["--n_head=3"], "n_embd=32 is not divisible by n_head=3"),
    (["--device=cuda"], "no CUDA device"),
    (["--warmup_iters=10", "--lr_decay_iters=10"], "needs warmup_iters < lr_decay_iters"),
    (["--min_lr=1.0"], "min_lr <= learning_rate"),
    (["--eval_only=True", "--eval_iters=0"], "eval_only=True needs eval_iters > 0"),
    (["--seed=-5"], "seed=-5 is outside 0..2**44-1"),
    (["--seed=17592186044416"], "seed=17592186044416 is outside 0..2**44-1"),  # (2**44: a traceback in the init)
    (["--out_dir="], "out_dir is empty"),  # (it passed the writable check, then failed creating '')
    (["--block_size=200000"], "too few for block_size=200000"),  # (the val split has about 110,000)
    (["--device=tpu"], "unknown device 'tpu' (choose cpu, cuda or cuda:N)"),
    (["--grad_clip=-1.0"], "grad_clip=-1.0 is negative"),  # (it trained unclipped)
    (["--dropout=1.0"], "dropout=1.0 is outside [0, 1)"),
    (["--beta2=1.5"], "beta2=1.5 is outside [0, 1)"),
    (["--dist_timeout_s=0"], "dist_timeout_s=0 must be at least 1"),
    (["--n_embd=0"], "n_embd=0 must be at least 1"),  # (0 divides by any n_head: it failed in the model)
    (["--dist_backend=custom_fsdp", "--replicate_degree=-2"], "replicate_degree=-2 must be at least 1"),
    (["--out_dir={tmp}/a_file"], "out_dir {tmp}/a_file is a file, not a directory"),  # (it said "not writable")
    (["--backend=custom_fsdp"], "unknown backend 'custom_fsdp' (the process group's: nccl or gloo: "
                                "for the distributed trainer, --dist_backend=custom_fsdp)")],  # (it trained DDP)
    ids=["accumulation", "eval_interval", "heads", "cuda", "decay_before_warmup_ends", "min_lr_above_peak",
         "eval_only_without_batches", "negative_seed", "seed_past_64_bits", "empty_out_dir",
         "block_longer_than_the_data", "unknown_device", "negative_grad_clip", "dropout_of_one", "beta_above_one",
         "no_timeout", "no_width", "no_replicas",
         "out_dir_a_file", "process_group_backend"])
def test_impossible_settings_are_refused(args, tmp_path, setting, named):
    if "cuda" in setting[0] and __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    (tmp_path / "a_file").write_text("")
    setting, named = [s.format(tmp=tmp_path) for s in setting], named.format(tmp=tmp_path)
    cmd = launcher(None) + [REPO / "train.py", f"--out_dir={tmp_path}", *args, "--device=cpu", *setting]
    assert named in one_error_line(launch(cmd, timeout=120))


def test_compile_without_a_cpp_compiler_is_one_line(args, tmp_path):
    """torch.compile on CPU builds C++ kernels: with no compiler it failed at the first step, in a
    traceback of several screens."""
    cmd = launcher(None) + [REPO / "train.py", f"--out_dir={tmp_path / 'out'}", *args, "--device=cpu", "--compile=True"]
    line = one_error_line(launch(cmd, timeout=120, env={"CXX": str(tmp_path / "no-such-c++")}))
    assert "compile=True on CPU needs a C++ compiler" in line and "--compile=False" in line


@pytest.fixture(scope="module")
def saved(args, tmp_path_factory):
    return trained(tmp_path_factory, "saved", 2, *args, "--max_iters=4")


def test_resume_rejects_a_different_model_shape(args, saved):
    line = one_error_line(run_train(saved, 2, *args, "--dist_backend=custom_fsdp", "--init_from=resume", "--n_embd=64"))
    assert "n_embd=32" in line and "n_embd=64" in line
    # n_head changes no parameter's shape: the weights would load, into another model
    line = one_error_line(run_train(saved, None, *args, "--dist_backend=ddp", "--init_from=resume", "--n_head=4"))
    assert "n_head=2 but this run asks n_head=4" in line


def test_resume_rejects_a_newer_format_version(args, saved, tmp_path):
    out = tmp_path / "newer"
    subprocess.run(["cp", "-r", str(saved), str(out)], check=True)
    manifest_path = out / "ckpt-0000004" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["format_version"] = 99
    manifest_path.write_text(json.dumps(manifest))
    assert "format version 99" in one_error_line(run_train(out, 1, *args, "--dist_backend=ddp", "--init_from=resume"))


def test_resume_of_a_finished_run_says_there_is_nothing_to_train(args, saved):
    """max_iters at the checkpoint's iteration: one line and a clean exit (a late torchrun restart
    lands here too), with nothing evaluated, logged or saved."""
    before = {p.relative_to(saved): p.read_bytes() for p in saved.rglob("*") if p.is_file()}
    res = run_train(saved, 2, *args, "--dist_backend=custom_fsdp", "--init_from=resume", "--max_iters=4")
    assert res.returncode == 0 and "nothing to train (raise --max_iters to continue)" in res.stdout, res.describe()
    assert {p.relative_to(saved): p.read_bytes() for p in saved.rglob("*") if p.is_file()} == before


def test_resume_with_a_world_size_that_does_not_divide_accumulation(args, saved):
    line = one_error_line(run_train(saved, 3, *args, "--dist_backend=custom_fsdp", "--init_from=resume"))
    assert "not divisible by the world size 3" in line


def test_out_dir_not_writable(args, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    line = one_error_line(launch(launcher(None) + [REPO / "train.py", f"--out_dir={blocker / 'out'}",
                                                   "--device=cpu", *args], timeout=120))
    assert "not writable" in line


def test_resume_on_data_with_a_larger_vocabulary_is_refused(args, saved, char_data, tmp_path):
    import pickle
    data = tmp_path / "data"
    shutil.copytree(char_data, data)
    with open(data / "meta.pkl", "rb") as f:
        meta = pickle.load(f)
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump({**meta, "vocab_size": meta["vocab_size"] + 10}, f)
    line = one_error_line(run_train(saved, 1, *args, f"--data_dir={data}", "--dist_backend=ddp", "--init_from=resume"))
    assert f"vocabulary of {meta['vocab_size']} tokens" in line


def test_a_bad_setting_under_torchrun_is_one_line(args, tmp_path):
    """Every process parses the arguments; only the first prints what is wrong (the others wait for
    it to, since torchrun stops them all once one exits), and torchrun's failure report carries
    the message too (on another node it is the only place it shows)."""
    cases = [("--no_such_key=1", "unknown config key 'no_such_key'"),  # configurator.py
             ("--dist_backend=foo", "unknown dist_backend 'foo'"),  # train.py
             ("--dist_timeout_s=0", "dist_timeout_s=0 must be at least 1")]  # (checked before the process group's timeout)
    if not __import__("torch").cuda.is_available():  # before the process group: every rank exits at once
        cases.append(("--device=cuda", "device=cuda but this torch has no CUDA device"))
    for bad, named in cases:
        res = run_train(tmp_path, 2, *args, bad, torchrun=True)
        assert named in one_error_line(res)
        assert f"traceback : {named}" in res.stderr, res.describe()  # (a process torchrun stopped first has none)


def test_resume_takes_this_runs_optimizer_settings(args, saved, tmp_path):
    """Loading the optimizer's state must not bring back the saved run's weight decay and betas."""
    runs = {}
    for beta1 in (0.9, 0.1):
        out = tmp_path / f"beta1_{beta1}"
        subprocess.run(["cp", "-r", str(saved), str(out)], check=True)
        res = run_train(out, 2, *args, "--dist_backend=custom_fsdp", "--init_from=resume", "--max_iters=6",
                        f"--beta1={beta1}")
        assert res.returncode == 0, res.describe()
        runs[beta1] = losses(out)
    assert runs[0.9][5] != runs[0.1][5]  # the step at iteration 4 used the new beta1


def test_resume_keeps_the_checkpoints_best_val_loss(args, saved, tmp_path):
    """With always_save_checkpoint=False a resumed run saves only a validation loss below the
    checkpoint's best (made unbeatable here: the manifest carries no checksum), not its first one."""
    out = tmp_path / "out"
    subprocess.run(["cp", "-r", str(saved), str(out)], check=True)
    manifest_path = out / "ckpt-0000004" / "manifest.json"
    manifest_path.write_text(json.dumps({**json.loads(manifest_path.read_text()), "best_val_loss": 0.5}))
    res = run_train(out, None, *args, "--dist_backend=custom_fsdp", "--init_from=resume", "--max_iters=8",
                    "--always_save_checkpoint=False")
    assert res.returncode == 0 and "step 8: train loss" in res.stdout, res.describe()
    assert sorted(p.name for p in out.glob("ckpt-*")) == ["ckpt-0000004"]


def test_a_float32_checkpoint_resumes_under_float16_with_a_fresh_loss_scale(args, saved, tmp_path):
    """A checkpoint without a loss scale (saved in float32, by custom_fsdp) resumed by DDP in float16."""
    out = tmp_path / "out"
    subprocess.run(["cp", "-r", str(saved), str(out)], check=True)
    assert json.loads((out / "ckpt-0000004" / "manifest.json").read_text())["loss_scale"] == {}
    res = run_train(out, None, *args, "--dist_backend=ddp", "--dtype=float16", "--init_from=resume", "--max_iters=8")
    assert res.returncode == 0, res.describe()
    scale = json.loads((out / "ckpt-0000008" / "manifest.json").read_text())["loss_scale"]
    assert scale["scale"] == 65536.0 and scale["_growth_tracker"] == 4, scale  # GradScaler's start, four steps on


def test_float16_loss_scale_is_checkpointed_and_skips_close_the_step(args, tmp_path):
    res = run_train(tmp_path, 1, *args, "--dist_backend=ddp", "--dtype=float16", "--max_iters=4")
    assert res.returncode == 0, res.describe()
    manifest_path = tmp_path / "ckpt-0000004" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["loss_scale"]["_growth_tracker"] == 4  # four steps without an overflow
    manifest["loss_scale"]["scale"] = 2.0  # (the manifest itself carries no checksum)
    manifest_path.write_text(json.dumps(manifest))
    res = run_train(tmp_path, 1, *args, "--dist_backend=ddp", "--dtype=float16", "--init_from=resume")
    assert res.returncode == 0, res.describe()
    resumed = json.loads((tmp_path / "ckpt-0000008" / "manifest.json").read_text())["loss_scale"]
    assert resumed["scale"] == 2.0 and resumed["_growth_tracker"] == 8  # carried on, not reset to 65536
    # a skipped step under loss scaling: the scaler must be told, or the next step's unscale_ raises
    bad = ["--learning_rate=1e9", "--warmup_iters=0", "--decay_lr=False", "--grad_clip=0.0", "--on_nonfinite=skip"]
    res = run_train(tmp_path / "skip", 1, *args, "--dist_backend=ddp", "--dtype=float16", "--max_iters=12",
                    "--eval_interval=100", "--max_skipped_steps=2", *bad)
    assert "steps in a row had a non-finite loss" in one_error_line(res)
