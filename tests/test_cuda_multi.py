"""
What several GPUs show, on one: train.py as W fake hosts over NCCL (scripts/fakehosts.py, one
torchrun per rank, each with an NCCL_HOSTID of its own, all on cuda:0). custom_fsdp against FSDP2 bit
for bit at W=2, 3 and 4 (fp32, bf16, compile, CPU offload, ZeRO-2, no prefetch, HSDP 2x2, rows that
do not divide by 3), against ddp within a tolerance, exact and cross-backend resume, and the 1.3B
model at W=4: numbers and per-rank memory against FSDP2's. Timings mean nothing here (the ranks
time-share the GPU). Skips without CUDA. scripts/gpu_suite.sh runs it with tests/test_cuda.py.

Each launch spends 10-20 s starting torchrun, torch and NCCL, so the small runs go at once (module
fixtures) and every assert reads the runs they made.
"""
import json
import os
import pickle
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import REPO, clone_checkpoint, launch, losses, subprocess_env

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
import fakehosts  # noqa: E402
import training  # noqa: E402
import planner  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CONCURRENT_LAUNCHES = 10  # small launches at once: about 25 processes of ~1 GB each on the GPU, 16 cores
LAUNCH_TIMEOUT_S = 240  # a hung launch is stopped well inside scripts/gpu_suite.sh's 540 s
ITERS, CKPT = 8, 4  # every small run checkpoints at 4 and 8; resumes start from 4
SMALL = ["--device=cuda", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4",
         "--dropout=0.0", "--compile=False", "--dtype=float32", "--deterministic=True", "--wrap_policy=block",
         "--log_interval=1", "--eval_iters=2", f"--eval_interval={CKPT}", f"--max_iters={ITERS}", "--decay_lr=False",
         "--learning_rate=1e-2", "--gradient_accumulation_steps=4"]
# each runs under custom_fsdp and fsdp, which must agree bit for bit: (world size, what differs from SMALL)
PAIRS = {
    "fp32": (2, []),
    "bf16_compile": (2, ["--dtype=bfloat16", "--compile=True"]),
    "w4": (4, []),
    "hsdp_2x2": (4, ["--replicate_degree=2"]),
    "w3_uneven": (3, ["--gradient_accumulation_steps=6"]),  # n_embd=32 rows (and more) split 11/11/10
    "bf16": (2, ["--dtype=bfloat16"]),
    "offload": (2, ["--cpu_offload=True"]),
    "zero2": (2, ["--reshard_after_forward=False"]),
    "no_prefetch": (2, ["--prefetch=False"]),
}
# compile in each process itself: a pool of compile workers per rank (16 processes each importing torch)
# would cost more than these small graphs take to compile
COMPILE_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
# DDP all-reduces whole gradients in buckets where custom_fsdp reduce-scatters each unit's, and the
# grad norm sums squares in another order (whole tensors; shards, then across ranks): last-bit
# differences may appear and grow over the steps (~1e-7 in fp32 over 8 steps). A real fault (a wrong
# gradient scale, a lost shard) moves the losses by 1e-3 or more
DDP_TOL = 1e-5
CROSS_TOL = 1e-5  # a resume at another world size sums in another order, as above

BIG = ["--device=cuda", str(REPO / "config" / "model_1b.py"), "--block_size=1024", "--batch_size=1",
       "--gradient_accumulation_steps=4", "--dtype=bfloat16", "--max_iters=2", "--eval_iters=0", "--keep_checkpoints=0",
       "--deterministic=True", "--log_interval=1", "--compile=False", "--dropout=0.0", "--decay_lr=False"]
BIG_WORLD = 4
BIG_ENV = {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "2"}  # more loopback bandwidth for 1.3B's shards
BIG_TOL = 1e-3  # custom_fsdp vs fsdp, relative on losses, only where the control run itself is not bitwise
RESERVED_TOL = 1.10  # the caching allocator's segments depend on the order of allocations, not only on need
STATE_TOL = 0.01  # model state per rank against 16 bytes per parameter / W (padding of uneven rows)


def record(check, **fields):
    """One line of the summary scripts/gpu_suite.sh prints, where it asks for one ($GPU_SUITE_SUMMARY)."""
    path = os.environ.get("GPU_SUITE_SUMMARY")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"check": check, **fields}) + "\n")


def rel(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def compare(check, world, got_out, want_out, tol=None, iters=range(ITERS)):
    """got_out's losses and grad norms equal want_out's (tol None), or its losses within tol relative;
    records the largest relative difference either way."""
    keys = ("loss", "grad_norm") if tol is None else ("loss",)
    got, want = ({(k, i): v for k in keys for i, v in losses(out, k).items() if i in iters}
                 for out in (got_out, want_out))
    assert {i for _, i in want} == set(iters), f"{check}: iterations {sorted(want)}"
    assert sorted(got) == sorted(want), f"{check}: iterations {sorted(got)} != {sorted(want)}"
    diff = max(rel(got[k], want[k]) for k in want)
    ok = got == want if tol is None else diff <= tol
    record(check, world=world, want="bitwise" if tol is None else f"<= {tol:g} relative", max_rel_diff=diff, ok=ok)
    bad = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert ok, f"{check}: largest relative difference {diff:.3g}; differing: {dict(list(bad.items())[:6])}"


def train(out, world, backend, *args, env=None):
    res = fakehosts.launch(world, REPO / "train.py", [f"--out_dir={out}", f"--dist_backend={backend}", *args],
                           timeout=LAUNCH_TIMEOUT_S, env=subprocess_env() | (env or {}), cwd=REPO)
    return out, res


def worker(out, world):
    """tests/multi_worker.py as `world` fake hosts; it writes its verdict to `out`."""
    res = fakehosts.launch(world, REPO / "tests" / "multi_worker.py", [out], timeout=LAUNCH_TIMEOUT_S,
                           env=subprocess_env())
    return out, res


def resume(source, out, world, backend, *args):
    """Resume at world size `world` from the checkpoint at CKPT of the run `source` (a future) made."""
    src_out, src_res = source.result()
    if src_res.returncode != 0:
        return out, fakehosts.Result(1, [f"{src_out} failed: nothing to resume"], [], False)
    clone_checkpoint(src_out, CKPT, out)
    return train(out, world, backend, *args, "--init_from=resume")


def ok(runs, name):
    """The out_dir of run `name`, which must have succeeded."""
    out, res = runs[name]
    assert res.returncode == 0, f"{name}: {res.describe()}"
    return out


@pytest.fixture(scope="module")
def small(char_data, tmp_path_factory):
    """Every small run, CONCURRENT_LAUNCHES launches at a time: each pair under both sharded backends,
    fp32 under ddp, the NCCL worker, and the resumes of fp32-custom_fsdp's checkpoint once it exists."""
    tmp = tmp_path_factory.mktemp("multi")
    args = [f"--data_dir={char_data}", *SMALL]
    with ThreadPoolExecutor(CONCURRENT_LAUNCHES) as pool:
        runs = {}
        for case, (world, extra) in PAIRS.items():  # (longest first: compile, then the larger worlds)
            for backend in ("custom_fsdp", "fsdp"):
                env = COMPILE_ENV if "--compile=True" in extra else None
                runs[f"{case}-{backend}"] = pool.submit(train, tmp / f"{case}-{backend}", world, backend, *args, *extra,
                                                        env=env)
        runs["fp32-ddp"] = pool.submit(train, tmp / "fp32-ddp", 2, "ddp", *args)
        runs["worker"] = pool.submit(worker, tmp / "worker.json", 2)
        source = runs["fp32-custom_fsdp"]
        runs["resume-same"] = pool.submit(resume, source, tmp / "resume-same", 2, "custom_fsdp", *args)
        runs["resume-cross"] = pool.submit(resume, source, tmp / "resume-cross", 4, "fsdp", *args)
        return {name: job.result() for name, job in runs.items()}


@pytest.mark.parametrize("case", list(PAIRS))
def test_custom_fsdp_trains_on_fsdp2s_bits(small, case):
    """Same data, same init, deterministic kernels, the same collectives over NCCL: the same losses and
    grad norms, bit for bit, at every iteration."""
    world = PAIRS[case][0]
    compare(f"{case}: custom_fsdp vs fsdp", world, ok(small, f"{case}-custom_fsdp"), ok(small, f"{case}-fsdp"))


def test_w3_rows_do_not_divide(char_data):
    """The W=3 pair shards rows that 3 does not divide (FSDP pads them): checked, not assumed."""
    from model import GPT, GPTConfig
    vocab = pickle.loads((char_data / "meta.pkl").read_bytes())["vocab_size"]
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=vocab, bias=False))
    uneven = [n for n, p in model.named_parameters() if p.shape[0] % 3]
    assert "transformer.h.0.attn.c_proj.weight" in uneven, uneven


def test_custom_fsdp_trains_as_ddp(small):
    compare("fp32: custom_fsdp vs ddp", 2, ok(small, "fp32-custom_fsdp"), ok(small, "fp32-ddp"), tol=DDP_TOL)


def test_no_reshard_after_backward_with_accumulation(small):
    """train.py has no setting for it: tests/multi_worker.py keeps units gathered between micro-steps
    under both implementations, on NCCL, and compares them on every rank."""
    out = json.loads(ok(small, "worker").read_text())
    ours, theirs = (out[impl]["losses"] + out[impl]["norms"] for impl in ("ours", "fsdp2"))
    record("reshard_after_backward=False, accumulation: ours vs FSDP2 (worker)", world=out["world"], want="bitwise",
           max_rel_diff=max(rel(a, b) for a, b in zip(ours, theirs)), max_param_diff=out["param_max_diff"],
           ok=out["bitwise"])
    assert out["moved"], "some parameter did not train"
    assert out["bitwise"], out


def test_resume_is_exact(small):
    """Stopped at 4 (its checkpoint), resumed to 8 by the same backend at the same world size: the
    unbroken run's iterations 4-7, bit for bit."""
    compare("resume custom_fsdp W=2 at 4 vs unbroken", 2, ok(small, "resume-same"), ok(small, "fp32-custom_fsdp"),
            iters=range(CKPT, ITERS))


def test_resume_under_another_backend_and_world(small):
    compare("resume as fsdp W=4 from custom_fsdp W=2 at 4 vs unbroken", 4, ok(small, "resume-cross"),
            ok(small, "fp32-custom_fsdp"), tol=CROSS_TOL, iters=range(CKPT, ITERS))


# ---- 1.3B at W=4 --------------------------------------------------------------------------------

def rehearse(out, backend, data_dir):
    """The 1.3B model through the rehearsal CLI, as users run it (memory checked before, reported after)."""
    cmd = [sys.executable, REPO / "scripts" / "fakehosts.py", f"--nproc={BIG_WORLD}", f"--timeout={LAUNCH_TIMEOUT_S}",
           REPO / "train.py", f"--out_dir={out}", f"--dist_backend={backend}", f"--data_dir={data_dir}", *BIG]
    return out, launch(cmd, LAUNCH_TIMEOUT_S + 60, env=BIG_ENV)


def peaks(out):
    """(peak allocated, reserved, model state) in MiB per rank: max over ranks and stages."""
    rows = fakehosts.last_run_memory_rows(out)
    assert rows, f"no memory rows in {out}/metrics.jsonl"
    return (max(r["max_allocated_mb"] for r in rows), max(r["reserved_mb"] for r in rows),
            max(r["params_mb"] + r["grads_mb"] + r["optim_mb"] for r in rows))


@pytest.fixture(scope="module")
def big(char_data, tmp_path_factory):
    """fsdp first; then fsdp again (the control: is the model itself deterministic?) and custom_fsdp,
    at once where the GPU holds two jobs of the first one's reserved memory, else one after the other."""
    tmp = tmp_path_factory.mktemp("big")
    runs = {"fsdp": rehearse(tmp / "fsdp", "fsdp", char_data)}
    rest = {"control": "fsdp", "custom_fsdp": "custom_fsdp"}
    first_ok = runs["fsdp"][1].returncode == 0
    outside = planner.CUDA_CONTEXT_BYTES + planner.NCCL_COMMUNICATOR_BYTES  # (per process, beside the reserve)
    need = 2 * BIG_WORLD * (peaks(tmp / "fsdp")[1] * 2**20 + outside) if first_ok else None
    at_once = need is not None and need <= 0.9 * torch.cuda.get_device_properties(0).total_memory
    with ThreadPoolExecutor(2 if at_once else 1) as pool:
        jobs = {name: pool.submit(rehearse, tmp / name, backend, char_data) for name, backend in rest.items()}
        runs |= {name: job.result() for name, job in jobs.items()}
    record("1.3B launches", world=BIG_WORLD, at_once=at_once)
    return runs


def big_out(big, name):
    out, res = big[name]
    assert res.returncode == 0, f"{name}: {res.describe()}"
    return out


def test_1b_custom_fsdp_vs_fsdp(big):
    """Bit for bit where fsdp run twice is (the control); within BIG_TOL where even that differs."""
    fsdp, control, custom = (big_out(big, n) for n in ("fsdp", "control", "custom_fsdp"))
    deterministic = all(losses(control, k) == losses(fsdp, k) for k in ("loss", "grad_norm"))
    spread = max(rel(v, losses(fsdp)[i]) for i, v in losses(control).items())
    record("1.3B control: fsdp vs fsdp", world=BIG_WORLD, want="(tells bitwise from BIG_TOL below)",
           max_rel_diff=spread, ok=deterministic)
    compare("1.3B bf16: custom_fsdp vs fsdp", BIG_WORLD, custom, fsdp, tol=None if deterministic else BIG_TOL,
            iters=range(2))


def test_1b_memory_per_rank(big, char_data):
    """custom_fsdp's peak allocated memory per rank is at most FSDP2's, its reserved within
    RESERVED_TOL of FSDP2's, and each backend's model state per rank is 16 bytes per parameter / W."""
    fsdp, custom = big_out(big, "fsdp"), big_out(big, "custom_fsdp")
    settings = training.settings([*BIG, f"--data_dir={char_data}"])
    want_state = fakehosts.BYTES_PER_PARAM * fakehosts.parameter_count(settings) / BIG_WORLD / 2**20
    (peak_c, reserved_c, state_c), (peak_f, reserved_f, state_f) = peaks(custom), peaks(fsdp)
    record("1.3B memory per rank (MiB)", world=BIG_WORLD, want_state=want_state,
           custom_fsdp=dict(peak=peak_c, reserved=reserved_c, state=state_c),
           fsdp=dict(peak=peak_f, reserved=reserved_f, state=state_f),
           ok=peak_c <= peak_f and reserved_c <= RESERVED_TOL * reserved_f)
    assert "fakehosts: memory per rank (max over ranks): peak allocated" in big["custom_fsdp"][1].stdout
    for name, state in (("custom_fsdp", state_c), ("fsdp", state_f)):
        assert abs(state / want_state - 1) <= STATE_TOL, f"{name}: model state {state:.0f} MiB vs {want_state:.0f}"
    assert peak_c <= peak_f, f"peak allocated per rank: custom_fsdp {peak_c:.0f} MiB > fsdp {peak_f:.0f} MiB"
    assert reserved_c <= RESERVED_TOL * reserved_f, \
        f"reserved per rank: custom_fsdp {reserved_c:.0f} MiB vs fsdp {reserved_f:.0f} MiB"

