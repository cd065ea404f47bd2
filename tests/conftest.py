"""Shared fixtures and helpers for the tests that launch train.py (and friends) as subprocesses."""
import atexit
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

import pytest

from spawn import Server, free_port

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import metrics  # noqa: E402
SPAWN = str(REPO / "tests" / "spawn.py")

# a model small enough that a whole run is dominated by process start-up
TINY = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4",
        "--eval_iters=2", "--log_interval=1", "--compile=False", "--dropout=0.0", "--dtype=float32"]

TRAIN_KEYS = set(metrics.STEP)  # a step's row in metrics.jsonl


class RunResult(NamedTuple):
    returncode: int
    stdout: str
    stderr: str

    def describe(self):
        return f"exit {self.returncode}\n--- stdout ---\n{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-6000:]}"


CACHE = tempfile.mkdtemp(prefix="fsdp-gpt-test-cache-")
atexit.register(shutil.rmtree, CACHE, True)


def clean_calibration():
    """A calibration of plausible figures for this CPU, clean by planner/calibrate.py's checks."""
    from planner import calibrate
    points = [[3.3e4, 3e-4], [5.2e5, 8e-4], [4.2e6, 5e-3], [1.7e7, 2e-2]]  # (bus bytes, seconds)
    gloo = {kind: points for kind in ("all_gather", "reduce_scatter", "all_reduce")}
    return {"key": calibrate._key(), "cores": os.cpu_count(), "one_thread": [{"torch.float32": 8e10,
            "torch.bfloat16": 1.6e11}, 2.5e10], "all_cores": [{"torch.float32": 8e10 * os.cpu_count(),
            "torch.bfloat16": 1.6e11 * os.cpu_count()}, 3e10], "gloo": {"2": gloo, "4": gloo},
            "gloo_alone": {"2": gloo, "4": gloo}, "gloo_takes": {"2": 0.5, "4": 0.5},
            "drift": {"2": 0.05, "4": 0.05}, "typical_over_best": 1.05, "op_seconds": 5e-6,
            "load": {"others_cores": 0.0, "steal": 0.0, "seconds": 5.0}, "measured_at": "2026-01-01 00:00:00",
            "attempts": 1, "problems": [], "contended": False}


def write_calibration(cache):
    """The tests' plans of CPU runs replay on clean_calibration(), written into `cache` (their
    XDG_CACHE_HOME): no test measures this CPU's figures beside other tests' load, but
    test_calibrate.py, which checks how they are measured."""
    folder = os.path.join(cache, "fsdp-gpt")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "cpu-calibration.json"), "w") as f:
        json.dump(clean_calibration(), f)


write_calibration(CACHE)


def subprocess_env():
    env = dict(os.environ)
    # (faulthandler: a process that crashes, say with SIGSEGV, prints its threads' Python stacks)
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    # plan.py's CPU calibration, measured beside other tests' runs, stays out of the user's cache
    env["XDG_CACHE_HOME"] = CACHE
    # never inherit a launcher's rendezvous variables: a plain `python train.py` must be one process
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    return env


_server, _server_lock = None, threading.Lock()


def start(cmd, cwd=REPO, env=None, fork=True):
    """Start `cmd` in a session of its own, with `env` added to subprocess_env(). Returns a Popen,
    or for `python ...` and `python tests/spawn.py N ...` the Popen-like Run of this worker's fork
    server (tests/spawn.py), which starts them without an interpreter's start-up; torchrun, when
    such a run starts it, starts its workers through the server too (PYTHON_EXEC). fork=False: a
    real process tree, for the tests that look for processes by their environment."""
    global _server
    cmd, env = [str(c) for c in cmd], {**subprocess_env(), **(env or {})}
    if cmd[0] != sys.executable or not fork:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    with _server_lock:  # (tests may start runs from several threads)
        if _server is None:
            _server = Server(tempfile.mkdtemp(prefix="spawn-"), subprocess_env())
            atexit.register(_server.close)
    env.setdefault("PYTHON_EXEC", _server.python)
    if cmd[1] == SPAWN:
        return _server.start(cmd[3:], int(cmd[2]), env, cwd)
    return _server.start(cmd[1:], None, env, cwd)


def signal_group(pid, sig):
    """Signal the process group of a run, which may have exited already (its last process gone)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def launch(cmd, timeout, cwd=REPO, env=None, fork=True):
    """Run `cmd` (see start); on timeout kill the whole process group (no orphans)."""
    proc = start(cmd, cwd, env, fork)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        signal_group(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(map(str, cmd))}\n"
                    f"--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-6000:]}")
    return RunResult(proc.returncode, out, err)


def launcher(nproc, torchrun=False, job_id=True):
    """python for one process (nproc 0/None); for nproc >= 1 tests/spawn.py, which starts the
    processes as torchrun --standalone does without its seconds of start-up, or with
    torchrun=True torchrun itself (for the tests of what torchrun adds: restarts, teardown, its
    failure report): --standalone, or with job_id=False neither it nor --rdzv_id, so that the
    job's id is torchrun's default `none`."""
    if not nproc:
        return [sys.executable]
    if not torchrun:
        return [sys.executable, SPAWN, str(nproc)]
    base = [sys.executable, "-m", "torch.distributed.run"]  # (torchrun's own entry point, which start() forks)
    return base + (["--standalone"] if job_id else [f"--master_port={free_port()}"]) + [f"--nproc_per_node={nproc}"]


def run_train(tmp_out, nproc, *args, timeout=300, env=None, torchrun=False):
    """train.py with out_dir=tmp_out on the CPU; returns RunResult(returncode, stdout, stderr)."""
    cmd = launcher(nproc, torchrun) + [REPO / "train.py", f"--out_dir={tmp_out}", "--device=cpu", *args]
    return launch(cmd, timeout, env=env)


def one_error_line(res):
    """The one `error:` line a failed run printed (a bad input must give exactly one)."""
    lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode != 0 and len(lines) == 1, res.describe()
    return lines[0]


def load_metrics(out_dir):
    """(train rows, eval rows) of out_dir/metrics.jsonl, in file order."""
    run = metrics.read(str(out_dir))
    return run.steps, run.evals


def losses(out_dir, key="loss"):
    """{iter: value} of the train rows (a later row for the same iter wins, as after a resume)."""
    return {r["iter"]: r[key] for r in load_metrics(out_dir)[0]}


def clone_checkpoint(src_out, ckpt_iter, dst_out):
    """A fresh out_dir holding only src_out's checkpoint of iteration ckpt_iter, as `latest`."""
    name = f"ckpt-{ckpt_iter:07d}"
    dst_out = Path(dst_out)
    dst_out.mkdir(parents=True)
    shutil.copytree(Path(src_out) / name, dst_out / name)
    (dst_out / "latest").write_text(name)
    return dst_out


# the generated corpus's words and speakers: together they spell tiny Shakespeare's 65 characters
# (letters, digit 3, newline, space and !$&',-.:;?), so that the tests that size a model by the
# character vocabulary (65 rows) and the prompts they sample from ("ROMEO:") hold on it
WORDS = ("a", "be", "come", "do", "even", "fair", "good", "heart", "if", "joy", "king", "love", "my", "night",
         "of", "poor", "queen", "rest", "sweet", "thou", "upon", "villain", "what", "vex", "yet", "zeal",
         "the", "and", "to", "is", "not", "with", "'tis", "o'er", "well-met", "&c", "3", "$3")
SPEAKERS = ("ROMEO", "JULIET", "KING HENRY", "QUEEN", "FALSTAFF", "BUCKINGHAM", "PAULINA", "VOLUMNIA",
            "WARWICK", "EXTON", "YORK", "ZANY", "DUCHESS", "GLOUCESTER")


def make_corpus(path, size=200_000, seed=1337):
    """Write a play-shaped text of about `size` characters to `path` and return it: speeches of
    words drawn from WORDS. random.Random, not numpy: the same text on every machine and version."""
    rng = random.Random(seed)
    speeches, n = [], 0
    while n < size:
        lines = [rng.choice(SPEAKERS) + ":"]
        for _ in range(rng.randint(1, 4)):
            words = [rng.choice(WORDS) + (rng.choice(",,,;:") if rng.random() < 0.1 else "")
                     for _ in range(rng.randint(3, 10))]
            lines.append(" ".join(words).capitalize().rstrip(",;:") + rng.choice("..,;!?"))
        speeches.append("\n".join(lines) + "\n\n")
        n += len(speeches[-1])
    text = "".join(speeches)
    Path(path).write_bytes(text.encode("ascii"))  # (bytes: no newline translation)
    return text


# GPT-2's first merges: the tiny BPE's tokens are GPT-2's first 268, with the same ids
TINY_MERGES = ("Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "Ġt he", "e r", "Ġ s", "a t", "Ġ w", "Ġ o")


def write_tiny_bpe(folder):
    """GPT-2-format vocab.bpe and encoder.json in `folder` (for GPT2_BPE_DIR): the 256 byte tokens,
    each spelled as GPT-2's files spell it (the printable bytes but space as themselves, then the
    others as chr(256), chr(257), ...), then TINY_MERGES; returns `folder`."""
    printable = [chr(b) for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    tokens = printable + [chr(256 + n) for n in range(256 - len(printable))] + [m.replace(" ", "") for m in TINY_MERGES]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.bpe").write_text("#version: 0.2\n" + "".join(m + "\n" for m in TINY_MERGES), encoding="utf-8")
    ids = {t: i for i, t in enumerate(tokens)}
    (folder / "encoder.json").write_text(json.dumps({**ids, "<|endoftext|>": len(ids)}), encoding="utf-8")
    return folder


@pytest.fixture(scope="session")
def char_data(tmp_path_factory):
    """The generated corpus, character-level, prepared once per session by data/shakespeare_char/prepare.py."""
    corpus = tmp_path_factory.mktemp("corpus") / "input.txt"
    make_corpus(corpus)
    out = tmp_path_factory.mktemp("char_data")
    res = launch([sys.executable, REPO / "data" / "shakespeare_char" / "prepare.py",
                  "--input", corpus, "--out_dir", out], timeout=300)
    assert res.returncode == 0, res.describe()
    return out


@pytest.fixture(scope="session")
def tiny_args(char_data):
    """The tiny model on the prepared data; tests append what they vary."""
    return [f"--data_dir={char_data}", *TINY]


# the files that take longest, longest first, run first: with `-n 2 --dist loadfile` each file goes
# whole to the next free worker, in this order, so a long file taken last would leave the other
# worker idle while it runs
SLOWEST_FILES = ("test_train.py", "test_fsdp_impl.py", "test_failures.py", "test_bench.py", "test_pretrained.py",
                 "test_fakehosts.py")


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return SLOWEST_FILES.index(name) if name in SLOWEST_FILES else len(SLOWEST_FILES)
    items.sort(key=rank)  # (stable: each file's tests keep their order)
