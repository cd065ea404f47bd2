"""Every command-line entry point answers alike: --help (and -h) lists its own flags with their
defaults and exits 0; bad input is one `error:` line on stderr and exit 2, before any data is read."""
import pytest

from conftest import REPO, launch, launcher

# (script, what its help must show): its own flags, and a default value beside one. The help is
# compared with its whitespace collapsed, as argparse wraps it to the terminal's width
HELP = [
    ("train.py", ["--max_iters=2000", "--dist_backend='ddp'"]),
    ("sample.py", ["--num_samples=3", "--max_new_tokens=300"]),
    ("plan.py", ["--nproc='1,2,4,8' world sizes to plan", "--gpu='' a100, h100 or h200", "--dtype='bfloat16'"]),
    ("bench.py", ["--backends BACKENDS rows, comma-separated (default: ddp,fsdp,custom_fsdp)",
                  "--repeats REPEATS runs per backend, interleaved (default: 3)"]),
    ("compare.py", ["OUT_DIR run directories holding metrics.jsonl", "--out OUT", "(default: compare.png)"]),
    ("overlap.py", ["TRACE profiler traces", "--png PATH",
                    "--step N with --png: draw ProfilerStep#N alone (default: every profiled step)"]),
    # (its one argument, a folder: the default is where the export goes)
    ("checkpoint.py", ["usage: checkpoint.py [-h] OUT_DIR", "written to OUT_DIR/ckpt.pt"]),
    ("scripts/fakehosts.py", ["--nproc NPROC ranks, one fake host each (required)",
                              "--timeout TIMEOUT seconds before everything is stopped (default: 3600)"]),
    ("scripts/plan_check.py", ["--json JSON", "--nproc NPROC world sizes, comma-separated (default: 1,2)",
                               "--backends BACKENDS backends, comma-separated (default: ddp,fsdp,custom_fsdp)"]),
]

# (script, bad arguments, the error line): relative paths start in the repository, where none of these exist
BAD = [
    ("train.py", ["--no_such_key=1"], "error: unknown config key 'no_such_key'"),
    ("sample.py", ["--num_samples=0"], "error: num_samples=0 must be at least 1"),
    ("plan.py", ["--json", "plan.json"], "error: --json takes its value after '=': --json=VALUE"),
    ("bench.py", ["--backends=zero"],
     "error: bench.py: --backends: unknown backend 'zero' in 'zero' (choose one of ddp, fsdp, custom_fsdp)"),
    ("bench.py", ["--render", "--nproc=2"], "error: bench.py: --render reads results/ and runs nothing: "
                                            "--nproc is not for it"),
    ("compare.py", [], "error: compare.py: the following arguments are required: OUT_DIR"),
    ("overlap.py", ["no_such_trace.json"], "error: cannot read no_such_trace.json: No such file or directory"),
    ("checkpoint.py", ["no_such_run"], "error: no checkpoint in no_such_run (no 'no_such_run/latest')"),
    ("scripts/fakehosts.py", ["--nproc=two", "train.py"],
     "error: fakehosts.py: argument --nproc: invalid int value: 'two'"),
    ("scripts/plan_check.py", ["--json=no_such_dir/plan.json", "--nproc=two"],
     "error: plan_check.py: --nproc=two: world sizes, comma-separated, each at least 1"),
]


@pytest.mark.parametrize("script,shown", HELP, ids=[script for script, _ in HELP])
def test_help_lists_the_flags_and_their_defaults(script, shown):
    outputs = []
    for flag in ("--help", "-h"):
        res = launch(launcher(None) + [REPO / script, flag], timeout=60)
        assert res.returncode == 0 and not res.stderr, res.describe()
        outputs.append(res.stdout)
    assert outputs[0] == outputs[1]
    text = " ".join(outputs[0].split())
    for words in shown:
        assert words in text, outputs[0]


@pytest.mark.parametrize("script,args,line", BAD, ids=[f"{script}:{' '.join(args)}" for script, args, _ in BAD])
def test_bad_input_is_one_error_line_and_exit_2(script, args, line):
    res = launch(launcher(None) + [REPO / script, *args], timeout=60)
    assert res.returncode == 2 and res.stderr.splitlines() == [line] and not res.stdout, res.describe()
    assert not (REPO / "no_such_dir").exists()  # (bad input writes nothing: plan_check.py made no --json folder)
