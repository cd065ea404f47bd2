"""The tools around training, on good and bad input: sample.py picks the newest checkpoint and
names it, the trace analyser, bench.py and the prepare scripts refuse bad input in one line."""
import importlib.util
import io
import json
import shutil
import socket
import sys
import urllib.error
import urllib.request

import pytest
import torch

from conftest import REPO, clone_checkpoint, free_port, launch, one_error_line, run_train

sys.path.insert(0, str(REPO))
import overlap  # noqa: E402

TINY = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=2", "--eval_interval=3",
        "--eval_iters=1", "--compile=False"]


def python(*args):
    return launch([sys.executable, *args], timeout=120)


def sample(out_dir, *args):
    return python(REPO / "sample.py", f"--out_dir={out_dir}", "--device=cpu", "--num_samples=1",
                  "--max_new_tokens=20", *args)


@pytest.fixture(scope="module")
def trained(char_data, tmp_path_factory):
    """out_dir with checkpoints of iterations 3 and 6 (latest) and a stale ckpt.pt exported at 3,
    and the iteration-6 checkpoint exported on its own (fresh/ckpt.pt)."""
    root = tmp_path_factory.mktemp("trained")
    out, args = root / "out", [f"--data_dir={char_data}", *TINY]
    res = run_train(out, None, *args, "--max_iters=3")
    assert res.returncode == 0, res.describe()
    res = python(REPO / "checkpoint.py", out)
    assert res.returncode == 0 and "iteration 3" in res.stdout, res.describe()
    res = run_train(out, None, *args, "--max_iters=6", "--init_from=resume")
    assert res.returncode == 0, res.describe()
    fresh = clone_checkpoint(out, 6, root / "fresh")
    res = python(REPO / "checkpoint.py", fresh)
    assert res.returncode == 0 and "iteration 6" in res.stdout, res.describe()
    return out, fresh / "ckpt.pt"


def test_resume_after_a_half_written_metrics_line_starts_a_new_one(char_data, tmp_path):
    """A run killed mid-write leaves half a row at the end of metrics.jsonl; the resumed run's first
    row was glued to it, and so lost to every reader."""
    args = [f"--data_dir={char_data}", *TINY, "--eval_iters=0"]  # (no eval row: the first appended row is a step's)
    assert run_train(tmp_path, None, *args, "--max_iters=3").returncode == 0
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"iter": 3, "lo')
    res = run_train(tmp_path, None, *args, "--max_iters=5", "--init_from=resume")
    assert res.returncode == 0, res.describe()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines.count('{"iter": 3, "lo') == 1
    rows = [json.loads(line) for line in lines if line != '{"iter": 3, "lo']
    assert [r["iter"] for r in rows if "loss" in r] == [0, 1, 2, 3, 4]


def test_sample_takes_the_newer_of_ckpt_pt_and_latest(trained, char_data, tmp_path):
    """The one saved later: after a resume from an older checkpoint, the higher iteration is older."""
    out, fresh_pt = trained
    from_dcp = sample(out)  # latest (6) is newer than the exported ckpt.pt (3)
    assert from_dcp.returncode == 0, from_dcp.describe()
    assert f"loaded {out / 'ckpt-0000006'} (iteration 6)" in from_dcp.stderr.splitlines()
    # the other way round: latest at 3, ckpt.pt exported at 6
    older = clone_checkpoint(out, 3, tmp_path / "older")
    shutil.copy(fresh_pt, older / "ckpt.pt")
    from_pt = sample(older)
    assert from_pt.returncode == 0, from_pt.describe()
    assert f"loaded {older / 'ckpt.pt'} (iteration 6)" in from_pt.stderr.splitlines()
    # the same weights either way, and stdout holds only the samples
    assert from_pt.stdout == from_dcp.stdout and "loaded" not in from_dcp.stdout
    # training goes on from 3: its iteration 5 is newer than the export of 6, which it abandoned
    res = run_train(older, None, f"--data_dir={char_data}", *TINY, "--max_iters=5", "--init_from=resume")
    assert res.returncode == 0, res.describe()
    resumed = sample(older)
    assert f"loaded {older / 'ckpt-0000005'} (iteration 5)" in resumed.stderr.splitlines(), resumed.describe()


def test_sample_without_the_character_table_says_where_it_looked(trained, char_data, tmp_path):
    """A character-level model whose meta.pkl is not where it is looked for (the run's relative
    data_dir, sampled from another folder): sample.py took GPT-2's BPE and failed in the model."""
    line = one_error_line(sample(trained[0], f"--data_dir={tmp_path}"))
    assert f"no {tmp_path / 'meta.pkl'} (the model's 65-token vocabulary" in line and "--data_dir=" in line, line
    res = sample(trained[0], f"--data_dir={char_data}")
    assert res.returncode == 0 and len(res.stdout.split("---------------")[0]) > 1, res.describe()


def test_sample_top_k_0_draws_from_every_token(trained):
    res = sample(trained[0], "--top_k=0")
    assert res.returncode == 0 and len(res.stdout.split("---------------")[0]) > 1, res.describe()


def test_sample_starts_an_empty_prompt_from_a_newline(trained):
    res = sample(trained[0], "--start=")
    assert res.returncode == 0, res.describe()
    assert res.stdout.startswith("\n") and len(res.stdout.split("---------------")[0]) > 1


def test_generate_draws_no_padded_vocabulary_id():
    """A vocabulary padded for speed (GPT-2's 50257 to 50304) has ids no tokenizer decodes: sample.py
    passes the tokenizer's size, and generate() never draws above it (tiktoken raised a KeyError)."""
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=16)).eval()
    idx = torch.zeros(1, 1, dtype=torch.long)
    # a high temperature makes the draws near uniform: 6 in 16 land on the "padding" unless masked
    padded = model.generate(idx, 40, temperature=100.0)[0, 1:]
    assert (padded >= 10).any()  # so the check below can fail
    assert (model.generate(idx, 40, temperature=100.0, vocab_size=10)[0, 1:] < 10).all()


def test_generate_at_top_k_1_or_a_tiny_temperature_is_greedy():
    """top_k=1 keeps only the largest logit (masking it too left all -inf: a nan probability
    tensor), and a tiny temperature divides the logits into an argmax (multiplying by it would
    flatten them to near uniform): both draw what a greedy argmax loop picks, past block_size too."""
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=16)).eval()
    idx = greedy = torch.zeros(1, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(10):
            logits = model(greedy[:, -8:])[0][:, -1, :]
            top2 = logits.topk(2).values[0]
            assert top2[0] - top2[1] > 1e-2  # no near ties: at temperature 1e-4 the draw is certain
            greedy = torch.cat((greedy, logits.argmax(-1, keepdim=True)), dim=1)
    assert len(set(greedy[0, 1:].tolist())) > 1  # (not one id throughout: a wrong draw shows)
    assert torch.equal(model.generate(idx, 10, top_k=1), greedy)
    assert torch.equal(model.generate(idx, 10, temperature=1e-4), greedy)


@pytest.mark.parametrize("start,fragments", [("{hello}", ["not in the vocabulary", ": '{}'"]),
                                              ("FILE:/no/such/prompt", ["cannot read /no/such/prompt"])])
def test_sample_refuses_a_bad_prompt(trained, start, fragments):
    line = one_error_line(sample(trained[0], f"--start={start}"))
    assert all(f in line for f in fragments), line


@pytest.mark.parametrize("setting,named", [("--temperature=0.0", "temperature=0.0 must be positive (top_k=1"),
                                           ("--top_k=-1", "top_k=-1 must be at least 0"),
                                           ("--num_samples=0", "num_samples=0 must be at least 1"),
                                           ("--max_new_tokens=-1", "max_new_tokens=-1 must be at least 0"),
                                           ("--device=tpu", "unknown device 'tpu'")])
def test_sample_refuses_impossible_settings(tmp_path, setting, named):
    """Before it looks for a checkpoint (tmp_path holds none). (Temperature 0 divided the logits by
    zero; a negative top_k, or a TPU, gave torch's traceback.)"""
    assert named in one_error_line(sample(tmp_path, setting))


@pytest.mark.parametrize("args,problem", [([], "the following arguments are required: OUT_DIR"),
                                          (["a", "b"], "unrecognized arguments: b")])
def test_checkpoint_export_without_one_out_dir_is_refused_in_one_line(args, problem):
    res = python(REPO / "checkpoint.py", *args)
    assert res.returncode == 2 and res.stderr.splitlines() == [f"error: checkpoint.py: {problem}"], res.describe()


def test_sample_reads_the_export_when_the_latest_manifest_is_damaged(trained, tmp_path):
    """The other way round from an unreadable ckpt.pt: a damaged latest checkpoint is named, and the
    export read (it stopped at the damage before)."""
    out, fresh_pt = trained
    damaged = clone_checkpoint(out, 6, tmp_path / "damaged")
    shutil.copy(fresh_pt, damaged / "ckpt.pt")
    (damaged / "ckpt-0000006" / "manifest.json").write_text("{not json")
    res = sample(damaged)
    assert res.returncode == 0, res.describe()
    assert f"checkpoint {damaged / 'ckpt-0000006'} has a corrupt manifest.json; reading {damaged / 'ckpt.pt'} " \
           "instead, which may be older" in res.stderr, res.stderr
    assert f"loaded {damaged / 'ckpt.pt'} (iteration 6)" in res.stderr.splitlines()


def test_sample_refuses_an_unreadable_ckpt_pt(tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"not a checkpoint")
    assert f"cannot read {tmp_path / 'ckpt.pt'}" in one_error_line(sample(tmp_path))


def test_overlap_without_a_trace_is_refused_in_one_line():
    res = python(REPO / "overlap.py")
    assert res.returncode == 2 and res.stderr.splitlines() == [
        "error: overlap.py: the following arguments are required: TRACE"], res.describe()


@pytest.mark.parametrize("content,problem", [(None, "No such file"), ("{not json", "is not JSON"),
                                             ('{"events": []}', "not a profiler trace")])
def test_overlap_refuses_a_bad_trace(tmp_path, content, problem, capsys):
    trace = tmp_path / "rank0.json"
    if content is not None:
        trace.write_text(content)
    with pytest.raises(SystemExit) as exit_:  # (what `python overlap.py TRACE` prints)
        overlap.load(trace)
    message = capsys.readouterr().err
    assert exit_.value.code == 2 and message.startswith("error:") and message.count("\n") == 1, message
    assert problem in message and str(trace) in message


@pytest.mark.parametrize("arg,named", [("--steps=2", "--steps=2: at least 3"),
                                       ("--backends=ddp,custom_fdsp", "unknown backend 'custom_fdsp'"),
                                       ("--sweep --repeats=2", "--sweep runs each world size once"),
                                       ("--backends=ddp,ddp", "--backends lists a row twice")])
def test_bench_refuses_bad_input_before_running(tmp_path, arg, named):
    res = python(REPO / "bench.py", *arg.split(), f"--work_dir={tmp_path / 'work'}")
    assert res.returncode == 2 and named in res.stderr.splitlines()[-1], res.describe()
    assert not (tmp_path / "work").exists()  # nothing ran (ddp, listed first, did not)


def load_script(path):
    """A script of the repo as a module, to call its functions in this process."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shakespeare_download_online_and_pass_input_offline(tmp_path, monkeypatch):
    """The reader both data/shakespeare*/prepare.py use."""
    tinyshakespeare = load_script(REPO / "data" / "tinyshakespeare.py")
    monkeypatch.delenv("SHAKESPEARE_INPUT", raising=False)

    def offline(url, timeout):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(SystemExit) as exit_:
        tinyshakespeare.read_text(None, str(tmp_path))
    message = str(exit_.value)
    assert message.startswith("error: cannot download") and "pass --input PATH" in message and "\n" not in message
    assert not list(tmp_path.iterdir())  # no empty or partial input.txt left to be taken for the text

    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: io.BytesIO(b"First Citizen:\n"))
    assert tinyshakespeare.read_text(None, str(tmp_path)) == "First Citizen:\n"
    assert [p.name for p in tmp_path.iterdir()] == ["input.txt"]


def test_openwebtext_offline_says_pass_a_local_copy(tmp_path, monkeypatch):
    prepare = load_script(REPO / "data" / "openwebtext" / "prepare.py")

    def offline(name, num_proc):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)")
    monkeypatch.setattr(prepare, "load_dataset", offline)
    monkeypatch.setattr(sys, "argv", ["prepare.py", f"--out_dir={tmp_path}"])
    with pytest.raises(SystemExit) as exit_:
        prepare.main()
    assert str(exit_.value).startswith("error: Couldn't reach 'openwebtext'") and "--dataset PATH" in str(exit_.value)


RANK_SCRIPT = """
import os, pathlib, sys, time
rank, here = int(os.environ["RANK"]), pathlib.Path(__file__).parent
env = [os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")]
os.write(1, (" ".join(env) + "\\n").encode())  # (one write: the ranks share the pipe)
(here / f"ready{rank}").touch()
if rank == int(sys.argv[1]):
    while len(list(here.glob("ready*"))) < 3:  # (the others have printed before it fails)
        time.sleep(0.01)
    sys.exit(3)
time.sleep(120 if int(sys.argv[1]) >= 0 else 0)
"""


@pytest.mark.parametrize("failing_rank", [-1, 0, 2])
def test_spawn_gives_ranks_torchruns_environment_and_stops_them_when_one_fails(tmp_path, failing_rank):
    """tests/spawn.py, the tests' launcher: each rank its RANK, one WORLD_SIZE and MASTER_PORT; a
    rank that fails (not only rank 0) stops the others at once and sets the exit code."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    res = python(REPO / "tests" / "spawn.py", "3", script, str(failing_rank))
    rows = sorted(line.split() for line in res.stdout.splitlines())
    assert [r[:3] for r in rows] == [["0", "0", "3"], ["1", "1", "3"], ["2", "2", "3"]], res.describe()
    assert len({r[3] for r in rows}) == 1
    assert res.returncode == (0 if failing_rank < 0 else 3), res.describe()  # (not the 120 s sleep's end)


PROBE = """
import os, sys
print(sys.argv, os.getcwd(), os.environ.get("PROBE"), __name__, sys.path[0], globals().get("__file__"))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("form", ["script", "-c"])
def test_a_forked_run_is_what_a_new_interpreter_would_be(tmp_path, form):
    """The fork server's run against a real `python` of the same command: the same argv, directory,
    environment, __main__, sys.path[0], __file__, output and exit code."""
    (tmp_path / "probe.py").write_text(PROBE)
    argv = ["probe.py", "7"] if form == "script" else ["-c", PROBE, "7"]
    forked, real = (launch([sys.executable, *argv], timeout=60, cwd=tmp_path, env={"PROBE": "x"}, fork=fork)
                    for fork in (True, False))
    assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr) \
        == (7, real.stdout, "to stderr\n"), (forked.describe(), real.describe())


# torchrun's view of a worker started through PYTHON_EXEC: a process whose run the server forked
CLIENT_OF_A_SLEEPER = """
import os, pathlib, signal, subprocess, sys, time
pid_file, how = pathlib.Path(sys.argv[1]), getattr(signal, sys.argv[2])
sleeper = "import os, pathlib, sys, time; pathlib.Path(sys.argv[1]).write_text(str(os.getpid())); time.sleep(60)"
client = subprocess.Popen([os.environ["PYTHON_EXEC"], "-u", "-c", sleeper, str(pid_file)])
while not pid_file.exists() or not pid_file.read_text():
    time.sleep(0.01)
run = int(pid_file.read_text())
os.kill(client.pid, how)
code = client.wait()
deadline = time.time() + 10
while os.path.exists(f"/proc/{run}") and time.time() < deadline:
    time.sleep(0.01)
print(run != client.pid, code, os.path.exists(f"/proc/{run}"))
"""


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_client_passes_signals_on_and_its_run_does_not_outlive_it(tmp_path, how):
    """SIGTERM to the client reaches the run, and the client exits as the run did; a SIGKILLed client
    takes the run along (as torchrun, stopping or killing a worker, expects)."""
    res = launch([sys.executable, "-c", CLIENT_OF_A_SLEEPER, tmp_path / "pid", how], timeout=60)
    assert res.stdout.split() == ["True", str(-getattr(__import__("signal"), how)), "False"], res.describe()


@pytest.mark.parametrize("pid_sent", [False, True], ids=["before_its_pid", "with_its_pid_unread"])
def test_a_client_gone_takes_its_run_along_and_the_server_serves_on(tmp_path, pid_sent):
    """A client killed before the server has told it its run's pid (torchrun stopping a worker at
    once), or after, with the pid unread (Linux then resets the connection): the server ends the run
    and serves the next request."""
    import os
    import select
    import time

    import conftest
    import spawn
    assert python("-c", "pass").returncode == 0  # (this worker's fork server is up)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(conftest._server.path)
        request = dict(argv=["-c", "import time; time.sleep(60)"], nproc=None, env=conftest.subprocess_env(),
                       cwd=str(tmp_path), fds=[0, 1, 2])
        with open(os.devnull, "rb") as null:
            spawn.send_request(sock, request, [null.fileno()] * 3)
        if pid_sent:
            assert select.select([sock], [], [], 30)[0], "the server never sent the run's pid"
    server = conftest._server.proc.pid  # (its only runs are this test's: a worker runs one test at a time)
    children = f"/proc/{server}/task/{server}/children"
    deadline = time.time() + 30  # (gone at once: the run is SIGKILLed, perhaps before it has started)
    while open(children).read().split() and time.time() < deadline:
        time.sleep(0.01)
    assert not open(children).read().split(), "the run outlived its client"
    assert python("-c", "print('still serving')").stdout == "still serving\n"


def test_a_free_port_comes_from_this_workers_block_below_the_ephemeral_range(monkeypatch):
    """Two xdist workers never draw the same port, and no socket bound to port 0 (which the kernel
    serves from its ephemeral range) takes one between the draw and rank 0's bind."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    ports = {free_port() for _ in range(20)}
    assert all(21000 <= p < 22000 for p in ports) and len(ports) > 1, ports
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        assert max(ports) < int(f.read().split()[0])
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # free indeed


def sample_function(name):
    """One function of sample.py, compiled alone (importing sample.py would run it)."""
    import ast
    tree = ast.parse((REPO / "sample.py").read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    scope = {}
    exec(compile(ast.Module(body=[node], type_ignores=[]), "sample.py", "exec"), scope)
    return scope[name]


def test_sample_picks_the_export_on_a_tie_and_falls_back_to_iterations():
    """A tie is the same checkpoint: the export (one file) is read. Without both save times, by iteration."""
    saved_no_earlier = sample_function("saved_no_earlier")
    assert saved_no_earlier({"saved_at": 5.0, "iter_num": 3}, {"saved_at": 5.0, "iter_num": 3})
    # resumed from an older checkpoint: the later save wins though its iteration is lower
    assert not saved_no_earlier({"saved_at": 5.0, "iter_num": 6}, {"saved_at": 9.0, "iter_num": 5})
    assert saved_no_earlier({"saved_at": 9.0, "iter_num": 5}, {"saved_at": 5.0, "iter_num": 6})
    assert saved_no_earlier({"saved_at": None, "iter_num": 6}, {"saved_at": 9.0, "iter_num": 6})
    assert not saved_no_earlier({"iter_num": 5}, {"saved_at": 9.0, "iter_num": 6})
