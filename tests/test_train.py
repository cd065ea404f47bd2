"""
train.py end to end on the CPU (gloo), with a tiny model: backend parity, world-size invariance,
exact resume, cross-backend resume, communication only on the last micro-step, torch.compile,
bad input, and metrics.jsonl.

Every launch costs seconds, so runs are made once by module-scoped fixtures and shared
by the tests that read them.
"""
import json
import math
import os
import pickle
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import (REPO, TRAIN_KEYS, clone_checkpoint, launch, launcher, load_metrics, losses,
                      one_error_line, run_train)

sys.path.insert(0, str(REPO))

BACKENDS_W2 = ("ddp", "fsdp", "custom_fsdp")

# config A: 2 global micro-batches, so at W=2 each rank runs exactly one and the gradient
# average has 2 summands (exact); no clipping
CONFIG_A = ["--gradient_accumulation_steps=2", "--grad_clip=0.0", "--max_iters=5", "--eval_interval=100"]
# config B: 4 global micro-batches (2 per rank at W=2), clipping on; checkpoints at 4 and 8.
# The tiny model's gradient norm is 0.64..0.77 over these steps, so grad_clip=1.0 would never
# clip: 0.5 makes clipping scale every step (asserted below)
GRAD_CLIP_B = 0.5
# a resume at another world size or backend: the same trajectory, its sums (loss, gradients) taken in
# another order, so apart by roundings (one float32 ulp of the loss, 4.8e-7, in float8's case)
CROSS_RESUME = 1e-5
CONFIG_B = ["--gradient_accumulation_steps=4", f"--grad_clip={GRAD_CLIP_B}", "--max_iters=8", "--eval_interval=4"]


def train_ok(out, nproc, *args, timeout=300):
    res = run_train(out, nproc, *args, timeout=timeout)
    assert res.returncode == 0, res.describe()
    return res


def rel(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def assert_close(got, want, tol, what, relative=False):
    """got/want: {iter: value}; same iterations, every value within tol (abs or relative)."""
    assert sorted(got) == sorted(want), f"{what}: iterations {sorted(got)} != {sorted(want)}"
    for i in sorted(want):
        diff = rel(got[i], want[i]) if relative else abs(got[i] - want[i])
        assert diff <= tol, f"{what}: iter {i}: {got[i]!r} vs {want[i]!r} (diff {diff:.3g} > {tol})"


def assert_bitwise(got, want, what):
    assert sorted(got) == sorted(want), f"{what}: iterations {sorted(got)} != {sorted(want)}"
    bad = {i: (got[i], want[i]) for i in want if got[i] != want[i]}
    assert not bad, f"{what}: not bitwise equal at {bad}"


def only(d, iters):
    return {i: d[i] for i in iters}


def error_lines(res):
    return [line for line in res.stderr.splitlines() if line.startswith("error:")]


def assert_one_error(res, *words):
    """Non-zero exit and exactly one stderr line 'error: ...' that names the problem."""
    assert res.returncode != 0, res.describe()
    lines = error_lines(res)
    assert len(lines) == 1, f"expected one 'error:' line, got {lines}\n{res.describe()}"
    for w in words:
        assert w.lower() in lines[0].lower(), f"{w!r} not in {lines[0]!r}"
    # no Python traceback from train.py itself (torchrun prints its own ChildFailedError report)
    assert 'train.py", line' not in res.stderr, res.describe()
    return lines[0]


def snapshot(path):
    """{relative path: bytes} of every file under path."""
    path = Path(path)
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------------------
# shared runs


def one_process_and_w2(base, tiny_args, config, single_backend):
    """The global batch on one process, then ddp, fsdp and custom_fsdp at W=2."""
    out = {"single": base / "single"}
    train_ok(out["single"], None, *tiny_args, *config, f"--dist_backend={single_backend}")
    for b in BACKENDS_W2:
        out[b] = base / b
        train_ok(out[b], 2, *tiny_args, *config, f"--dist_backend={b}")
    return out


@pytest.fixture(scope="module")
def runs_a(tmp_path_factory, tiny_args):
    """Config A: one process (the plain, unwrapped model: ddp at W=1) and the three at W=2."""
    return one_process_and_w2(tmp_path_factory.mktemp("config_a"), tiny_args, CONFIG_A, "ddp")


@pytest.fixture(scope="module")
def runs_b(tmp_path_factory, tiny_args):
    """Config B, 8 iterations with checkpoints at 4 and 8: one process and the three at W=2.

    The one process runs custom_fsdp (a process group of one), so it is also the W=1 run of the
    world-size test."""
    return one_process_and_w2(tmp_path_factory.mktemp("config_b"), tiny_args, CONFIG_B, "custom_fsdp")


# ---------------------------------------------------------------------------------------------
# 1. backend parity


def test_parity_one_microbatch_per_rank(runs_a):
    ref = losses(runs_a["single"])
    assert sorted(ref) == list(range(5))
    for b in BACKENDS_W2:
        assert_bitwise(losses(runs_a[b]), ref, f"loss {b} W=2 vs one process")
    norms = {k: losses(v, "grad_norm") for k, v in runs_a.items()}
    assert_bitwise(norms["custom_fsdp"], norms["fsdp"], "grad_norm custom_fsdp vs fsdp")
    # ddp (and the single process) take the norm of whole local tensors; the sharded backends
    # sum the squared norms of each rank's shards across ranks: a different summation order,
    # so the last bits may differ
    assert_close(norms["ddp"], norms["fsdp"], 1e-6, "grad_norm ddp vs fsdp", relative=True)
    assert_close(norms["single"], norms["ddp"], 1e-6, "grad_norm single vs ddp", relative=True)


def test_deterministic_kernels_keep_the_backends_bitwise(runs_a, tiny_args, tmp_path):
    """--deterministic=True picks deterministic kernels and math attention (the bits a GPU suite
    compares): both sharded backends still agree bit for bit, and with the default kernels to 1e-5."""
    for backend in ("fsdp", "custom_fsdp"):
        train_ok(tmp_path / backend, 2, *tiny_args, *CONFIG_A, f"--dist_backend={backend}", "--deterministic=True")
    assert_bitwise(losses(tmp_path / "custom_fsdp"), losses(tmp_path / "fsdp"), "deterministic custom_fsdp vs fsdp")
    assert_close(losses(tmp_path / "custom_fsdp"), losses(runs_a["custom_fsdp"]), 1e-5, "deterministic vs default")


def test_parity_two_microbatches_per_rank_with_clipping(runs_b):
    ref = losses(runs_b["single"])
    assert sorted(ref) == list(range(8))
    for key in ("loss", "grad_norm"):
        fsdp, custom = losses(runs_b["fsdp"], key), losses(runs_b["custom_fsdp"], key)
        assert_bitwise(custom, fsdp, f"{key} custom_fsdp vs fsdp (W=2, 2 micro-steps per rank)")
        for other in ("ddp", "single"):
            # accumulation adds micro-step gradients in a different order on one rank than on
            # two: not bitwise, but the same within float32 rounding
            assert_close(losses(runs_b[other], key), fsdp, 1e-5, f"{key} {other} vs fsdp", relative=True)
    # the norm is logged before clipping: above the threshold, so clipping really scaled the grads
    norms = losses(runs_b["single"], "grad_norm")
    assert all(v > GRAD_CLIP_B for v in norms.values()), norms


# ---------------------------------------------------------------------------------------------
# 2. world sizes 1, 2, 4


@pytest.fixture(scope="module")
def runs_world(tmp_path_factory, tiny_args, runs_b):
    base = tmp_path_factory.mktemp("world")
    # the first 5 iterations of B, evaluated at 0 and 4 as B is (and at the end); no checkpoints
    short = [*CONFIG_B[:2], "--max_iters=5", "--eval_interval=4", "--keep_checkpoints=0"]
    out = {("custom_fsdp", 1): runs_b["single"], ("custom_fsdp", 2): runs_b["custom_fsdp"]}
    for backend, w in (("custom_fsdp", 4), ("fsdp", 4)):
        d = base / f"{backend}-w{w}"
        train_ok(d, w, *tiny_args, *short, f"--dist_backend={backend}")
        out[(backend, w)] = d
    return out


def test_world_sizes_same_losses(runs_world):
    ref = only(losses(runs_world[("custom_fsdp", 1)]), range(5))
    for (backend, w), d in runs_world.items():
        got = only(losses(d), ref)
        # the global batch is the same; only the summation order of the gradient average differs
        assert_close(got, ref, 1e-5, f"loss {backend} W={w} vs custom_fsdp W=1")


def test_world_sizes_same_evaluation(runs_world):
    """eval_iters=2 at W=4: each rank evaluates one batch, and ranks 2 and 3 (past the 2 batches)
    must not count theirs: the evaluation is W=1's (within float32 rounding of the weights)."""
    def evals(d):
        return {r["iter"]: r for r in load_metrics(d)[1] if r["iter"] in (0, 4)}
    ref = evals(runs_world[("custom_fsdp", 1)])
    assert sorted(ref) == [0, 4]
    for (backend, w), d in runs_world.items():
        got = evals(d)
        for key in ("train_loss", "val_loss"):
            assert_close({i: r[key] for i, r in got.items()}, {i: r[key] for i, r in ref.items()}, 1e-5,
                         f"{key} {backend} W={w} vs custom_fsdp W=1")


# ---------------------------------------------------------------------------------------------
# 3. resume is exact (dropout on: masks are seeded by (seed, iteration, micro-batch))

# a learning-rate schedule whose every phase the 8 iterations meet: warmup (0, 1), cosine decay (2..5), min_lr (6, 7)
LR, MIN_LR, WARMUP, DECAY = 1e-3, 1e-4, 2, 5
RESUME_ARGS = [*CONFIG_B[:2], "--eval_interval=4", "--dropout=0.1", f"--learning_rate={LR}", f"--min_lr={MIN_LR}",
               f"--warmup_iters={WARMUP}", f"--lr_decay_iters={DECAY}"]


@pytest.fixture(scope="module", params=["custom_fsdp", "ddp"])
def resume_runs(request, tmp_path_factory, tiny_args):
    backend = request.param
    base = tmp_path_factory.mktemp(f"resume_{backend}")
    args = [*tiny_args, *RESUME_ARGS, f"--dist_backend={backend}"]
    whole, split = base / "whole", base / "split"
    train_ok(whole, 2, *args, "--max_iters=8")
    train_ok(split, 2, *args, "--max_iters=4")
    first = losses(split)
    res = train_ok(split, 2, *args, "--max_iters=8", "--init_from=resume")
    return backend, whole, split, first, res


def test_resume_bitwise(resume_runs):
    backend, whole, split, first, res = resume_runs
    assert sorted(first) == [0, 1, 2, 3]
    assert "ckpt-0000004" in res.stdout, res.describe()
    want = losses(whole)
    assert sorted(want) == list(range(8))
    got = losses(split)
    assert_bitwise(only(got, range(4, 8)), only(want, range(4, 8)), f"{backend} resumed losses 4..7")
    assert_bitwise(only(losses(split, "grad_norm"), range(4, 8)), only(losses(whole, "grad_norm"), range(4, 8)),
                   f"{backend} resumed grad_norm 4..7")
    # the evaluation after the last step too
    evals_whole = {r["iter"]: r["val_loss"] for r in load_metrics(whole)[1]}
    evals_split = {r["iter"]: r["val_loss"] for r in load_metrics(split)[1]}
    assert evals_split[8] == evals_whole[8]
    assert (Path(split) / "latest").read_text().strip() == "ckpt-0000008"


def test_dropout_changes_losses(resume_runs, runs_b):
    backend, whole, *_ = resume_runs
    with_dropout, without = losses(whole), losses(runs_b[backend])
    # (from iteration 1 on the learning-rate schedules differ too; iteration 0's loss differs by dropout alone)
    assert all(with_dropout[i] != without[i] for i in range(8)), "dropout=0.1 did not change the losses"


@pytest.fixture(scope="module")
def dropout_one_process(tmp_path_factory, tiny_args):
    """The resume runs' first 3 iterations on one process (custom_fsdp, a group of one)."""
    out = tmp_path_factory.mktemp("dropout_w1") / "out"
    train_ok(out, None, *tiny_args, *RESUME_ARGS, "--max_iters=3", "--keep_checkpoints=0", "--dist_backend=custom_fsdp")
    return out


def test_dropout_masks_do_not_depend_on_the_world_size(resume_runs, dropout_one_process):
    """A micro-batch's masks are seeded by its global index, not by the rank's micro-step: W=2
    (2 micro-steps per rank) draws the masks one process draws for the same micro-batches. Within
    float32 rounding: accumulation adds in another order on one rank than on two."""
    backend, whole, *_ = resume_runs
    assert_close(only(losses(whole), range(3)), losses(dropout_one_process), 1e-5,
                 f"loss {backend} W=2 vs one process, dropout=0.1", relative=True)


def expected_lr(it):
    """train.py's schedule, written out: linear warmup to LR over WARMUP + 1 steps, cosine to MIN_LR at DECAY."""
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    if it > DECAY:
        return MIN_LR
    return MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi * (it - WARMUP) / (DECAY - WARMUP))) / 2


def test_logged_lr_follows_the_schedule(resume_runs):
    """The lr logged at each step, in an unbroken run and in one resumed at 4 (the schedule
    depends on the iteration alone), is the closed form's, through warmup, decay and min_lr."""
    backend, whole, split, *_ = resume_runs
    for d in (whole, split):
        got = losses(d, "lr")
        assert sorted(got) == list(range(8))
        assert_close(got, {i: expected_lr(i) for i in range(8)}, 1e-12, f"{backend} lr", relative=True)
    assert got[0] == pytest.approx(LR / 3) and got[3] < LR and got[6] == got[7] == MIN_LR  # (every phase met)


# ---------------------------------------------------------------------------------------------
# 4. a checkpoint resumes under any backend and world size


@pytest.mark.parametrize("writer,reader,nproc", [
    ("custom_fsdp", "ddp", None),
    ("custom_fsdp", "fsdp", 4),
    ("ddp", "custom_fsdp", None),
    ("fsdp", "custom_fsdp", 4),  # (uneven shards: the 65-row embedding is 17, 17, 17 and 14 rows at W=4)
], ids=["custom_fsdp-w2-to-ddp-w1", "custom_fsdp-w2-to-fsdp-w4", "ddp-w2-to-custom_fsdp-w1", "fsdp-w2-to-custom_fsdp-w4"])
def test_cross_backend_resume(writer, reader, nproc, runs_b, tiny_args, tmp_path):
    out = clone_checkpoint(runs_b[writer], 4, tmp_path / "out")
    manifest = json.loads((out / "ckpt-0000004" / "manifest.json").read_text())
    assert manifest["dist_backend"] == writer and manifest["world_size"] == 2
    res = train_ok(out, nproc, *tiny_args, *CONFIG_B, f"--dist_backend={reader}", "--init_from=resume")
    assert "ckpt-0000004" in res.stdout, res.describe()
    got = losses(out)
    assert sorted(got) == list(range(4, 8))
    assert_close(got, only(losses(runs_b[writer]), range(4, 8)), CROSS_RESUME,
                 f"{writer} W=2 -> {reader} W={nproc or 1}")


# ---------------------------------------------------------------------------------------------
# 5. accumulation communicates on the last micro-step only (counted in tests/accum_worker.py)


@pytest.fixture(scope="module")
def accum_counts(tmp_path_factory):
    out = tmp_path_factory.mktemp("accum") / "counts.json"
    res = launch(launcher(2) + [REPO / "tests" / "accum_worker.py", out, *BACKENDS_W2, "fsdp+keep", "custom_fsdp+keep"],
                 timeout=300)
    assert res.returncode == 0, res.describe()
    return json.loads(out.read_text())


@pytest.mark.parametrize("backend", BACKENDS_W2)
def test_accumulation_syncs_on_last_microstep_only(accum_counts, backend):
    c = accum_counts[backend]
    counts = c["grad_collectives"]
    assert counts[0] == 0 and counts[1] == 0, f"{backend}: gradient collectives per micro-step {counts}"
    assert counts[2] > 0, f"{backend}: no gradient collective on the last micro-step: {counts}"
    if backend != "ddp":
        # one reduce-scatter per FSDP unit: one per block and the root
        assert c["units"] == c["n_layer"] + 1
        assert counts[2] == c["n_layer"] + 1, f"{backend}: {counts}"
        assert all(n > 0 for n in c["all_gathers"]), c  # the counting wrappers did see traffic
    assert c["has_grads"] and c["grads_agree"], c


@pytest.mark.parametrize("backend", ["fsdp", "custom_fsdp"])
def test_units_kept_gathered_across_micro_steps_gather_once(accum_counts, backend):
    """reshard_after_backward=False with reshard_after_forward=False: every unit gathered in the
    first forward only, the same gradient collectives, and the same gradients to the bit."""
    kept, default = accum_counts[f"{backend}+keep"], accum_counts[backend]
    assert kept["all_gathers"] == [kept["units"], 0, 0], kept["all_gathers"]
    assert kept["grad_collectives"] == default["grad_collectives"]
    assert kept["grads"] == default["grads"] and kept["grads_agree"]


# ---------------------------------------------------------------------------------------------
# 6. torch.compile


# inductor end to end under each backend: the sharded ones compile each block's forward and the output
# layer (the same graphs under fsdp and custom_fsdp, so the second finds them in inductor's cache);
# custom_fsdp with one unit compiles the whole forward, ddp the whole model
COMPILED = [("custom_fsdp", "block"), ("fsdp", "block"), ("custom_fsdp", "model"), ("ddp", "block")]


@pytest.mark.parametrize("backend,wrap_policy", COMPILED, ids=[f"{b}-{w}" for b, w in COMPILED])
def test_compile_matches_eager(runs_a, tiny_args, tmp_path, backend, wrap_policy):
    out = tmp_path / "compiled"
    args = [a for a in tiny_args if not a.startswith("--compile")]
    config = [a for a in CONFIG_A if not a.startswith("--max_iters")]
    train_ok(out, 2, *args, *config, "--max_iters=3", "--compile=True", f"--dist_backend={backend}",
             f"--wrap_policy={wrap_policy}", timeout=540)
    assert_close(losses(out), only(losses(runs_a[backend]), range(3)), 1e-4, "compiled vs eager")


# a script's start: the backend settings train.py passes make_backend, for a small CPU model;
# each script changes what it varies (dict(SETTINGS, compile=True))
SETTINGS_PRELUDE = """
SETTINGS = dict(device="cpu", dtype="float32", compile=False, cpu_offload=False, replicate_degree=1,
                wrap_policy="block", min_wrap_params=1, reshard_after_forward=True, prefetch=True,
                reshard_after_backward=True, float8=False)
"""

WRAP_AND_REPORT_GRAPHS = SETTINGS_PRELUDE + """
import sys
import torch
from backends import init_distributed, make_backend
from model import GPT, GPTConfig
init_distributed("custom_fsdp", "gloo", "cpu", 60)
with torch.device("meta"):
    gpt = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=0.0, bias=False))
# ('size': two blocks' parameters fill a unit, so the third is a smaller unit of its own)
cfg = dict(SETTINGS, wrap_policy=sys.argv[1], compile=True,
           min_wrap_params=2 * sum(p.numel() for p in gpt.transformer.h[0].parameters()))
model = make_backend("custom_fsdp", cfg).wrap(gpt, lambda m: m.init_weights(0))
compiled = lambda f: hasattr(f, "_torchdynamo_orig_callable")
# each block's unit, numbered in block order (None: no unit of its own, its parameters are the root's)
units = list(dict.fromkeys(b._fsdp_unit for b in model.transformer.h if hasattr(b, "_fsdp_unit")))
print(compiled(model.forward), [compiled(b.forward) for b in model.transformer.h], compiled(model.logits_and_loss),
      [units.index(b._fsdp_unit) if hasattr(b, "_fsdp_unit") else None for b in model.transformer.h])
"""


@pytest.mark.parametrize("wrap_policy,expected", [
    ("model", "True [False, False, False] False [None, None, None]"),  # one unit: the whole forward is one graph
    # a unit per block: its forward, and the output layer with the loss
    ("block", "False [True, True, True] True [0, 1, 2]"),
    ("size", "False [True, True, True] True [0, 0, 1]"),  # units of blocks: the last one's tail too
])
def test_compile_graphs_follow_the_units(wrap_policy, expected):
    res = launch([sys.executable, "-c", WRAP_AND_REPORT_GRAPHS, wrap_policy], timeout=120)
    assert res.returncode == 0, res.describe()
    assert res.stdout.strip().splitlines()[-1] == expected


# the start of a script run with a backend's name: that backend's 2-block GPT and AdamW, built as
# train.py builds them (`back`, `model`, `opt`)
BACKEND_GPT = SETTINGS_PRELUDE + """
import os
import sys
import torch
import torch.distributed as dist
from backends import init_distributed, make_backend
from model import GPT, GPTConfig
init_distributed(sys.argv[1], "gloo", "cpu", 60)
back = make_backend(sys.argv[1], SETTINGS)
with torch.device("meta"):
    gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=0.0, bias=False))
model = back.wrap(gpt, lambda m: m.init_weights(0))
opt = back.unwrap(model).configure_optimizers(0.1, 1e-3, (0.9, 0.95), back.optimizer_class)
"""

PREFETCH_ORDER = SETTINGS_PRELUDE + """
import torch
from backends import init_distributed, make_backend
from fsdp_impl.comm import ledger
from model import GPT, GPTConfig
init_distributed("custom_fsdp", "gloo", "cpu", 60)
x = torch.randint(0, 64, (2, 16))
for prefetch in (False, True):
    cfg = dict(SETTINGS, prefetch=prefetch)
    with torch.device("meta"):
        gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=0.0, bias=False))
    model = make_backend("custom_fsdp", cfg).wrap(gpt, lambda m: m.init_weights(0))
    for step in range(2):  # (the second: by then the units' order is known, so a default prefetch would run)
        ledger.reset(record_events=step == 1)
        model(x, x)[1].backward()
    ev = ledger.events
    print(prefetch, ev.index(("all_gather", "transformer.h.0")) < ev.index(("forward", "root")),
          ev.index(("all_gather", "transformer.h.1")) < ev.index(("forward", "transformer.h.0")))
"""


def test_prefetch_setting_reaches_the_units():
    """prefetch=False through make_backend: each block is gathered only when its forward starts,
    after the unit before it began computing; prefetch=True: before (one process: the ledger logs
    the gathers all the same)."""
    res = launch([sys.executable, "-c", PREFETCH_ORDER], timeout=120)
    assert res.returncode == 0, res.describe()
    assert res.stdout.strip().splitlines()[-2:] == ["False False False", "True True True"], res.describe()


STEP_AGAINST_ADAMW = BACKEND_GPT + """
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
with torch.device("meta"):  # a second copy of the model, stepped by torch's AdamW itself
    gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=0.0, bias=False))
model2 = back.wrap(gpt, lambda m: m.init_weights(0))
opt2 = back.unwrap(model2).configure_optimizers(0.1, 1e-3, (0.9, 0.95))
for o in (opt, opt2):
    for group in o.param_groups:  # AdamW's other settings (the fused kernel takes them too)
        group.update({"default": {}, "amsgrad_maximize": {"amsgrad": True, "maximize": True}}[sys.argv[2]])
hooks_run = []
opt.register_step_pre_hook(lambda *args: hooks_run.append("pre"))
opt.register_step_post_hook(lambda *args: hooks_run.append("post"))
local = lambda t: t.to_local() if isinstance(t, DTensor) else t
before = [local(p).clone() for p in model.parameters()]
specs, init = [0], DTensorSpec.__init__
def counting_init(self, *args, **kwargs):
    specs[0] += 1
    init(self, *args, **kwargs)
for step in range(4):
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
    for m, o in ((model, opt), (model2, opt2)):
        back.backward(m(x, x)[1])
        for group in o.param_groups:
            group["lr"] = 1e-3 * (step + 1)  # (train.py sets each step's lr so)
    DTensorSpec.__init__ = counting_init if step >= 1 else init  # (the first step creates the state)
    opt.step()
    DTensorSpec.__init__ = init
    opt2.step()
    for o in (opt, opt2):
        o.zero_grad(set_to_none=True)
same_params = all(torch.equal(local(p), local(q)) for p, q in zip(model.parameters(), model2.parameters()))
same_state = all(s.keys() == s2.keys() and all(torch.equal(local(s[k]), local(s2[k])) for k in s)
                 for s, s2 in zip(opt.state.values(), opt2.state.values()))
moved = all(not torch.equal(b, local(p)) for b, p in zip(before, model.parameters()))
if dist.get_rank() == 0:
    print(type(opt).__name__, len(opt.state), same_params, same_state, moved, ",".join(hooks_run),
          specs[0], flush=True)
dist.destroy_process_group()
os._exit(0)  # FSDP2 on gloo can abort in interpreter teardown after a clean run
"""


@pytest.mark.parametrize("settings", ["default", "amsgrad_maximize"])
@pytest.mark.parametrize("backend", ["fsdp", "custom_fsdp"])
def test_sharded_backends_adamw_steps_the_local_shards_to_adamws_bits(backend, settings):
    """The sharded backends' optimizer steps the local shards, past DTensor's dispatch: parameters
    and every state tensor equal, bit for bit, those of a copy stepped by torch's AdamW, over four
    steps at two ranks with the lr changing, with train.py's settings and with amsgrad and
    maximize on; its step hooks run; and once the state exists a step builds no DTensor spec
    (through DTensor's dispatch it would)."""
    res = launch(launcher(2) + ["-c", STEP_AGAINST_ADAMW, backend, settings], timeout=120)
    assert res.returncode == 0, res.describe()
    name, n_params, same_params, same_state, moved, hooks, specs = res.stdout.strip().splitlines()[-1].split()
    assert name == "AdamWOnLocalShards" and int(n_params) == 2 * 6 + 3  # 6 per block, wte, wpe, ln_f
    assert (same_params, same_state, moved) == ("True", "True", "True"), res.stdout
    assert hooks == ",".join(["pre,post"] * 4)  # at each step
    assert int(specs) == 0


def test_adamw_on_local_shards_refuses_what_it_does_not_do():
    """A closure and differentiable=True (torch's AdamW takes both): refused with an error, not
    stepped some other way."""
    from backends import AdamWOnLocalShards
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match="closure"):
        AdamWOnLocalShards([p]).step(lambda: 0.0)
    with pytest.raises(ValueError, match="differentiable"):
        AdamWOnLocalShards([p], differentiable=True).step()
    assert torch.equal(p.detach(), torch.ones(2))


CLIP_AGAINST_TORCH = BACKEND_GPT + """
x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
back.backward(model(x, x)[1])
whole = lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g
# the reference: torch's clip_grad_norm_ over every gradient, whole, in the model's order
reference = [torch.nn.Parameter(torch.empty_like(whole(p.grad))) for p in model.parameters()]
for r, p in zip(reference, model.parameters()):
    r.grad = whole(p.grad).clone()
want = torch.nn.utils.clip_grad_norm_(reference, 0.5)
got = back.clip_grad_norm(opt, 0.5)
grad_err = max(((whole(p.grad) - r.grad).abs().max() / r.grad.abs().max()).item()
               for p, r in zip(model.parameters(), reference))
# a norm below max_norm (now 0.5, after the clipping above): the grads are left as they are, to the bit
clipped = [whole(p.grad).clone() for p in model.parameters()]
back.clip_grad_norm(opt, 1000.0)
unchanged = all(torch.equal(whole(p.grad), c) for p, c in zip(model.parameters(), clipped))
if dist.get_rank() == 0:
    print(len(reference), want.item(), got.item() / want.item() - 1, grad_err, unchanged, flush=True)
dist.destroy_process_group()
os._exit(0)  # FSDP2 on gloo can abort in interpreter teardown after a clean run
"""


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "custom_fsdp"])
def test_clip_grad_norm_is_torchs_over_every_gradient(backend):
    """Each backend's clipping (over what the optimizer steps; the sharded backends on the local
    shards, their squared norms summed across ranks) gives the norm and the clipped gradients of
    torch.nn.utils.clip_grad_norm_ over every gradient whole, within float32 rounding (the order
    of the sum differs). A norm below max_norm leaves the grads as they are (not scaled up)."""
    res = launch(launcher(2) + ["-c", CLIP_AGAINST_TORCH, backend], timeout=120)
    assert res.returncode == 0, res.describe()
    n_params, norm, norm_err, grad_err, unchanged = res.stdout.strip().splitlines()[-1].split()
    assert int(n_params) == 2 * 6 + 3 and float(norm) > 0.5  # every parameter; and the clipping scales
    assert abs(float(norm_err)) < 1e-6 and float(grad_err) < 1e-6, (norm_err, grad_err)
    assert unchanged == "True", "clip_grad_norm(1000.0) changed gradients whose norm is 0.5"


def test_cpu_grad_norm_is_exact_to_float32_rounding_where_torchs_flat_norm_is_not():
    """On the CPU the clipping's norm sums row by row (on every thread, IMPLEMENTATION.md); torch's norm
    of a whole CPU tensor sums it in one float32 run, which errs by 6e-4 relative over this 16.7M-value
    tensor. Empty shards (a rank with no rows) and 1-D and 3-D tensors are taken too."""
    from backends import grad_norm
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(4096, 4096, generator=g), torch.randn(0, 8), torch.randn(3, generator=g),
             torch.randn(5, 2, 3, generator=g)]
    exact = torch.sqrt(sum((t.double() ** 2).sum() for t in grads))
    assert abs(grad_norm(grads).double() / exact - 1) < 1e-7
    assert abs(torch.nn.utils.get_total_norm(grads).double() / exact - 1) > 1e-4  # (what the test guards against)
    assert grad_norm([]) == 0 and grad_norm([torch.zeros(0, 3)]) == 0


# ---------------------------------------------------------------------------------------------
# 7. bad input: one 'error:' line, non-zero exit, nothing touched


def test_unknown_backend(tiny_args, tmp_path):
    res = run_train(tmp_path / "o", None, *tiny_args, "--max_iters=1", "--dist_backend=foo")
    assert_one_error(res, "dist_backend", "foo")


def test_accumulation_not_divisible_by_world_size(tiny_args, tmp_path):
    res = run_train(tmp_path / "o", 2, *tiny_args, "--max_iters=1", "--gradient_accumulation_steps=3",
                    "--dist_backend=custom_fsdp")
    assert_one_error(res, "gradient_accumulation_steps", "3")


def test_resume_without_checkpoint(tiny_args, tmp_path):
    res = run_train(tmp_path / "o", None, *tiny_args, "--max_iters=1", "--init_from=resume")
    assert_one_error(res, "checkpoint")
    assert not (tmp_path / "o").exists(), "a refused run left an out_dir behind"


def test_unknown_config_key_on_command_line(tiny_args, tmp_path):
    res = run_train(tmp_path / "o", None, *tiny_args, "--max_iters=1", "--foo=1")
    assert_one_error(res, "foo")


def test_unknown_config_key_in_file(tiny_args, tmp_path):
    cfg = tmp_path / "cfg.py"
    cfg.write_text("max_iters = 1\nfoo = 1\n")
    res = run_train(tmp_path / "o", None, cfg, *tiny_args)
    assert_one_error(res, "foo")


def test_eval_iters_zero_skips_evaluation(tiny_args, tmp_path):
    """eval_iters=0: no evaluation rows (not a NaN validation loss), and checkpoints are saved at
    every eval_interval even with always_save_checkpoint off: with no validation loss, none could
    count as improved, and the run would save nothing."""
    res = run_train(tmp_path / "o", None, *tiny_args, "--max_iters=2", "--eval_iters=0", "--eval_interval=1",
                    "--always_save_checkpoint=False")
    assert res.returncode == 0, res.describe()

    def no_nan(name):
        raise AssertionError(f"{name} in metrics.jsonl")
    with open(tmp_path / "o" / "metrics.jsonl") as f:
        rows = [json.loads(line, parse_constant=no_nan) for line in f]
    assert not any("val_loss" in r for r in rows) and sum("loss" in r for r in rows) == 2
    assert sorted(p.name for p in (tmp_path / "o").glob("ckpt-*")) == ["ckpt-0000001", "ckpt-0000002"]
    assert "Warning" not in res.stderr, res.describe()  # DCP warned at each save without a process group


@pytest.mark.parametrize("key", ["keep_checkpoints", "eval_iters", "min_wrap_params"])
def test_negative_counts(key, tiny_args, tmp_path):
    res = run_train(tmp_path / "o", None, *tiny_args, "--max_iters=1", f"--{key}=-1")
    assert_one_error(res, key, "-1")


def test_unknown_wrap_policy_is_refused_under_every_backend(tiny_args, tmp_path):
    res = run_train(tmp_path / "o", None, *tiny_args, "--max_iters=1", "--dist_backend=ddp", "--wrap_policy=foo")
    assert_one_error(res, "wrap_policy", "foo")


def test_unknown_dtype(tiny_args, tmp_path):
    res = run_train(tmp_path / "o", None, *tiny_args, "--max_iters=1", "--dtype=float8")
    assert_one_error(res, "dtype", "float8")


@pytest.mark.parametrize("damage,nproc", [("flip", 2), ("truncate", None)])
def test_damaged_checkpoint_is_refused_and_untouched(damage, nproc, runs_b, tiny_args, tmp_path):
    out = clone_checkpoint(runs_b["custom_fsdp"], 8, tmp_path / "out")
    ckpt = out / "ckpt-0000008"
    shards = sorted(ckpt.glob("*.distcp"))
    assert shards, sorted(os.listdir(ckpt))
    victim = shards[-1]
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        mid = len(data) // 2
        data[mid:mid + 8] = bytes(b ^ 0xFF for b in data[mid:mid + 8])
    else:
        data = data[:len(data) // 2]
    victim.write_bytes(bytes(data))
    before = snapshot(out)
    res = run_train(out, nproc, *tiny_args, *CONFIG_B[:2], "--max_iters=12", "--eval_interval=4",
                    "--dist_backend=custom_fsdp", "--init_from=resume")
    line = assert_one_error(res, victim.name)
    assert "corrupt" in line.lower() or "truncat" in line.lower(), line
    assert snapshot(out) == before, "a refused resume changed files in out_dir"


def _wider(manifest):
    manifest["model_args"]["n_embd"] = manifest["config"]["n_embd"] = 64
    return manifest


# The manifest carries no checksum of its own: edits that leave the file checks passing reach the
# manifest's readers and DCP's loader, which raises a BaseException (CheckpointException).
# damage -> (edit of the manifest, truncate the shards too, a word of the error line)
MANIFEST_DAMAGE = {
    "shape_not_in_the_shards": (_wider, False, "size mismatch"),
    "shards_truncated_and_unlisted": (lambda m: {**m, "files": {}}, True, "cannot load checkpoint"),
    "files_missing": (lambda m: {k: v for k, v in m.items() if k != "files"}, False, "'files'"),
    "not_an_object": (lambda m: [m], False, "not a JSON object"),
    "model_args_incomplete": (lambda m: {**m, "model_args": {"n_layer": 2}}, False, "n_embd"),
}


@pytest.mark.parametrize("damage", MANIFEST_DAMAGE)
def test_damaged_manifest_is_one_line_for_every_reader(damage, runs_b, tiny_args, tmp_path):
    """train.py's resume, checkpoint.py's export and sample.py each refuse in one line naming the
    problem (they printed tracebacks), and leave the files as they were."""
    edit, truncate, named = MANIFEST_DAMAGE[damage]
    out = clone_checkpoint(runs_b["custom_fsdp"], 8, tmp_path / "out")
    ckpt = out / "ckpt-0000008"
    if truncate:
        for shard in ckpt.glob("*.distcp"):
            shard.write_bytes(shard.read_bytes()[:100])
    manifest = ckpt / "manifest.json"
    manifest.write_text(json.dumps(edit(json.loads(manifest.read_text()))))
    before = snapshot(out)
    wider = ["--n_embd=64"] if damage == "shape_not_in_the_shards" else []  # (else train.py refuses the shape first)
    assert_one_error(run_train(out, 2, *tiny_args, *CONFIG_B[:2], *wider, "--max_iters=12", "--eval_interval=4",
                               "--dist_backend=custom_fsdp", "--init_from=resume"), str(ckpt), named)
    for tool in (["checkpoint.py", out], ["sample.py", f"--out_dir={out}", "--device=cpu", "--max_new_tokens=5"]):
        res = launch([sys.executable, REPO / tool[0], *tool[1:]], timeout=300)
        assert named.lower() in one_error_line(res).lower() and "Traceback" not in res.stderr, res.describe()
    assert snapshot(out) == before, "a refused load changed files in out_dir"


def test_sample_passes_over_an_unreadable_export(exported, tmp_path):
    """A damaged ckpt.pt beside a checkpoint directory: sample.py names it and samples from the directory."""
    out = tmp_path / "out"
    shutil.copytree(exported, out)
    (out / "ckpt.pt").write_bytes((out / "ckpt.pt").read_bytes()[:1000])
    res = launch([sys.executable, REPO / "sample.py", f"--out_dir={out}", "--device=cpu", "--num_samples=1",
                  "--max_new_tokens=5"], timeout=300)
    assert res.returncode == 0, res.describe()
    assert f"cannot read {out / 'ckpt.pt'}" in res.stderr and f"loaded {out / 'ckpt-0000008'}" in res.stderr, \
        res.describe()


def test_damaged_latest_names_the_intact_checkpoint_before_it(runs_b, tiny_args, tmp_path):
    """The error names the previous checkpoint (saved at 4) instead of taking it silently, and
    writing its name into `latest` resumes from it."""
    out = tmp_path / "out"
    shutil.copytree(runs_b["custom_fsdp"], out)  # (copy2 keeps the manifests' times, which order them)
    victim = sorted((out / "ckpt-0000008").glob("*.distcp"))[0]
    victim.write_bytes(victim.read_bytes()[:-16])
    resume = [*tiny_args, *CONFIG_B[:2], "--max_iters=12", "--eval_interval=4", "--dist_backend=custom_fsdp",
              "--init_from=resume"]
    line = assert_one_error(run_train(out, None, *resume), "ckpt-0000008", "corrupt")
    assert f"{out / 'ckpt-0000004'} is intact" in line and str(out / "latest") in line, line
    (out / "latest").write_text("ckpt-0000004")
    res = run_train(out, None, *resume)
    assert res.returncode == 0 and "resumed from" in res.stdout and "ckpt-0000004" in res.stdout, res.describe()
    # iteration 8 saved again replaced the damaged one, which went aside as .old until then
    assert (out / "latest").read_text() == "ckpt-0000012" and not list(out.glob("*.old"))


def test_a_crash_while_replacing_a_checkpoint_resumes_from_the_one_it_replaced(runs_b, tiny_args, tmp_path):
    """An iteration saved again moves its old checkpoint aside (.old), then the new one into place:
    a crash between the two leaves `latest` naming a directory that is not there, and the resume
    takes the one aside."""
    out = clone_checkpoint(runs_b["custom_fsdp"], 8, tmp_path / "out")
    (out / "ckpt-0000008").rename(out / "ckpt-0000008.old")
    res = run_train(out, None, *tiny_args, *CONFIG_B, "--dist_backend=custom_fsdp", "--init_from=resume",
                    "--max_iters=9", "--keep_checkpoints=0")
    assert res.returncode == 0 and f"resumed from {out / 'ckpt-0000008.old'}" in res.stdout, res.describe()


def test_eval_only_evaluates_the_checkpoint_as_the_run_did(runs_b, tiny_args, tmp_path):
    """eval_only on the W=2 run's final checkpoint: the validation loss that run logged at that
    iteration, bitwise (same backend and world size), in eval.jsonl; nothing trained or saved, and
    the run's metrics.jsonl untouched. It trains nothing, so the batch split need not divide."""
    out = tmp_path / "out"
    shutil.copytree(runs_b["custom_fsdp"], out)
    before = snapshot(out)
    res = run_train(out, 2, *tiny_args, *CONFIG_B, "--dist_backend=custom_fsdp", "--init_from=resume",
                    "--eval_only=True", "--gradient_accumulation_steps=3")
    assert res.returncode == 0, res.describe()
    rows = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    logged = {r["iter"]: r["val_loss"] for r in load_metrics(out)[1]}
    assert [(r["iter"], r["val_loss"], r["evaluated"]) for r in rows if "val_loss" in r] == \
        [(8, logged[8], str(out / "ckpt-0000008"))]
    assert not any("loss" in r for r in rows)
    assert {k: v for k, v in snapshot(out).items() if k != "eval.jsonl"} == before


@pytest.mark.parametrize("pointer,named", [("ckpt-0000099", "names ckpt-0000099, which is not in"),
                                           ("", "latest is empty")], ids=["missing", "empty"])
def test_latest_pointing_nowhere_is_named(pointer, named, runs_b, tiny_args, tmp_path):
    out = clone_checkpoint(runs_b["custom_fsdp"], 8, tmp_path / "out")
    (out / "latest").write_text(pointer)
    line = assert_one_error(run_train(out, None, *tiny_args, *CONFIG_B, "--dist_backend=custom_fsdp",
                                      "--init_from=resume", "--max_iters=12"), named)
    assert f"{out / 'ckpt-0000008'} is intact" in line, line


@pytest.fixture(scope="module")
def exported(runs_b, tmp_path_factory):
    """`python checkpoint.py OUT_DIR` on a copy of the fsdp W=2 run's final checkpoint."""
    out = clone_checkpoint(runs_b["fsdp"], 8, tmp_path_factory.mktemp("export") / "out")
    res = launch([sys.executable, REPO / "checkpoint.py", out], timeout=300)
    assert res.returncode == 0, res.describe()
    return out


def test_checkpoint_export(exported):
    import torch
    from model import GPT, GPTConfig
    import checkpoint
    saved = torch.load(exported / "ckpt.pt", map_location="cpu", weights_only=False)
    assert saved["iter_num"] == 8
    gpt = GPT(GPTConfig(**saved["model_args"]))
    gpt.load_state_dict(saved["model"])  # strict: every key, every shape
    # the same weights as the sharded checkpoint holds (read back through DCP directly)
    ref = GPT(GPTConfig(**saved["model_args"]))
    checkpoint.load_model_only(str(exported / "ckpt-0000008"), ref)
    for (name, a), (_, b) in zip(gpt.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), name
    assert gpt.lm_head.weight is gpt.transformer.wte.weight  # still tied after loading
    # trained: not the initial weights
    init = GPT(GPTConfig(**saved["model_args"]))
    init.init_weights(1337)
    assert not torch.equal(init.lm_head.weight, gpt.lm_head.weight)


def test_sample_loads_export(exported, tmp_path):
    only_pt = tmp_path / "only_pt"  # nothing but the export: no checkpoint directory to fall back on
    only_pt.mkdir()
    shutil.copy(exported / "ckpt.pt", only_pt / "ckpt.pt")
    res = launch([sys.executable, REPO / "sample.py", f"--out_dir={only_pt}", "--device=cpu",
                  "--num_samples=1", "--max_new_tokens=20", "--start=ROMEO:"], timeout=300)
    assert res.returncode == 0, res.describe()
    # decoded with the run's own character table: the prompt comes back, then 20 characters
    text = res.stdout.split("\n---------------\n")[0]
    assert text.startswith("ROMEO:") and len(text) == len("ROMEO:") + 20, res.describe()


# ---------------------------------------------------------------------------------------------
# 8. metrics.jsonl


def test_metrics_rows_complete(runs_a, runs_b):
    for runs, ga in ((runs_a, 2), (runs_b, 4)):
        for name, d in runs.items():
            train, evals = load_metrics(d)
            assert train, f"{d}: no train rows"
            for row in train:
                assert set(row) == TRAIN_KEYS, f"{name}: row {row} is not metrics.STEP's"
                for k in TRAIN_KEYS - {"mfu", "host_ms"}:  # mfu is None on a CPU (peak FLOPs unknown)
                    assert isinstance(row[k], (int, float)) and math.isfinite(row[k]), (name, k, row)
                assert row["dt_ms"] > 0 and row["tokens_per_sec"] > 0 and row["peak_mem_mb"] > 0
                # the global batch's tokens per step (batch_size 4, block_size 32), at any world size
                assert row["tokens_per_sec"] * row["dt_ms"] / 1000 == pytest.approx(ga * 4 * 32, rel=1e-9), (name, row)
                # the training thread's CPU time per phase; forward and backward always take some
                assert set(row["host_ms"]) == {"batch", "forward_backward", "clip", "optimizer"}, row
                assert row["host_ms"]["forward_backward"] > 0 and all(v >= 0 for v in row["host_ms"].values())
            assert [r["iter"] for r in train] == list(range(len(train)))
            for row in evals:
                assert {"iter", "train_loss", "val_loss"} <= set(row)


def test_weight_decay_on_the_matrices_and_embeddings_only():
    """configure_optimizers decays the weight matrices and the embeddings, not the LayerNorm gains
    and biases (nanoGPT's split), in one fused AdamW; every parameter once."""
    from model import GPT, GPTConfig
    gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=0.0, bias=True))
    opt = gpt.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    names = {id(p): n for n, p in gpt.named_parameters()}
    by_decay = {g["weight_decay"]: sorted(names[id(p)] for p in g["params"]) for g in opt.param_groups}
    matrices = ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"]
    assert by_decay[0.1] == sorted([f"transformer.h.0.{m}" for m in matrices] + ["transformer.wpe.weight",
                                                                                 "transformer.wte.weight"])
    assert by_decay[0.0] == sorted(n for n in names.values() if n not in by_decay[0.1])
    # a block's two LayerNorms and four biases, and ln_f's gain and bias
    assert all(n.endswith(".bias") or ".ln_" in n for n in by_decay[0.0]) and len(by_decay[0.0]) == 10
    assert opt.defaults["fused"]


def test_activation_checkpointing_runs_each_block_again_in_backward():
    """With activation_checkpointing each block's forward runs twice per step (once more when backward
    recomputes it), without it once; the numbers are the same either way (the parity tests), so only
    this count tells that it is on."""
    import model
    forward, calls = model.Block.forward, [0]

    def counted(self, x):
        calls[0] += 1
        return forward(self, x)
    x = torch.randint(0, 64, (2, 16))
    try:
        model.Block.forward = counted
        for on, runs in ((True, 2 * 3), (False, 3)):
            gpt = model.GPT(model.GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=64,
                                            dropout=0.0, bias=False, activation_checkpointing=on))
            calls[0] = 0
            gpt(x, x)[1].backward()
            assert calls[0] == runs, (on, calls[0])
    finally:
        model.Block.forward = forward


DDP_AUTOCAST = SETTINGS_PRELUDE + """
import torch
from backends import init_distributed, make_backend
init_distributed("ddp", "gloo", "cpu", 60)
for dtype in ("float32", "bfloat16", "float16"):
    with make_backend("ddp", dict(SETTINGS, dtype=dtype)).autocast():
        print(dtype, (torch.ones(2, 2) @ torch.ones(2, 2)).dtype)
"""


def test_ddp_computes_in_the_run_dtype():
    """DDP's matrix products run in the run's dtype under autocast (float16 with loss scaling)."""
    res = launch([sys.executable, "-c", DDP_AUTOCAST], timeout=120)
    assert res.returncode == 0, res.describe()
    assert res.stdout.strip().splitlines()[-3:] == ["float32 torch.float32", "bfloat16 torch.bfloat16",
                                                    "float16 torch.float16"], res.describe()


def test_estimate_mfu_is_palms_formula():
    """6N + 12 L H Q T FLOPs per token (N: the parameters but the position embeddings), over T
    tokens per sequence, per second, over the peak; None where the peak is unknown (the CPU)."""
    from model import GPT, GPTConfig
    L, H, d, T, V = 2, 2, 32, 32, 65
    gpt = GPT(GPTConfig(n_layer=L, n_head=H, n_embd=d, block_size=T, vocab_size=V, dropout=0.0, bias=False))
    n = 12 * L * d * d + 2 * L * d + V * d + d  # blocks' matrices and layer norms, wte (tied to lm_head), ln_f
    flops = (6 * n + 12 * L * H * (d // H) * T) * T * 3  # 3 sequences forward and backward
    assert gpt.estimate_mfu(3, 0.5, 1e9) == pytest.approx(flops / 0.5 / 1e9, rel=1e-12)
    assert gpt.estimate_mfu(3, 0.5, None) is None


def wandb_history(run_file):
    """The rows wandb.log() wrote to an offline run file: its records framed as a LevelDB log (32 KB
    blocks, a 7-byte header per chunk) after a 7-byte file header, each a wandb Record protobuf."""
    import struct
    from wandb.proto import wandb_internal_pb2
    data, block, pos, chunks, rows = run_file.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B", data[:16]
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])  # (checksum, length, full/first/middle/last)
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or its last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_wandb_offline_run_records_the_curves(tiny_args, tmp_path):
    """wandb gets the numbers metrics.jsonl has: every step's loss, grad norm and lr, and the
    evaluation. train.py leaves with os._exit, past wandb's own teardown: it must finish the run
    itself, or the offline run file holds a header and nothing else."""
    cmd = [*launcher(2), REPO / "train.py", f"--out_dir={tmp_path / 'out'}", "--device=cpu", *tiny_args,
           "--dist_backend=custom_fsdp", "--max_iters=3", "--eval_interval=3", "--keep_checkpoints=0", "--wandb_log=True"]
    res = launch(cmd, timeout=300, env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)})
    assert res.returncode == 0, res.describe()
    runs = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs  # rank 0 logs
    history = wandb_history(runs[0])
    train, evals = load_metrics(tmp_path / "out")
    steps = [row for row in history if "train/loss_step" in row]
    assert [(r["iter"], r["train/loss_step"], r["grad_norm"], r["lr"]) for r in steps] == \
        [(r["iter"], r["loss"], r["grad_norm"], r["lr"]) for r in train]
    assert len({r["lr"] for r in steps}) == len(steps) == 3, steps  # (in warmup: lr moves every step)
    assert [(r["iter"], r["train/loss"], r["val/loss"]) for r in history if "val/loss" in r] == \
        [(r["iter"], r["train_loss"], r["val_loss"]) for r in evals]


def test_wandb_without_a_login_is_one_line(tiny_args, tmp_path):
    """wandb_log=True online with no API key: one line that says so and how to log offline, before
    out_dir is made (it was wandb's traceback, after the model was built)."""
    env = {"WANDB_MODE": "online", "WANDB_API_KEY": "", "HOME": str(tmp_path), "WANDB_DIR": str(tmp_path),
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config")}  # (HOME: no ~/.netrc holds a key)
    res = run_train(tmp_path / "out", 2, *tiny_args, "--max_iters=3", "--wandb_log=True", env=env)
    line = one_error_line(res)
    assert "wandb_log=True" in line and "WANDB_MODE=offline" in line, line
    assert not (tmp_path / "out").exists()


def reference_step0_loss(data_dir, ga, seed=1337, batch_size=4, block_size=32):
    """The global-batch mean loss of iteration 0, computed here from the data and the init."""
    import torch
    from model import GPT, GPTConfig
    with open(Path(data_dir) / "meta.pkl", "rb") as f:
        vocab = pickle.load(f)["vocab_size"]
    gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=block_size, vocab_size=vocab,
                        dropout=0.0, bias=False))
    gpt.init_weights(seed)
    data = np.memmap(Path(data_dir) / "train.bin", dtype=np.uint16, mode="r")
    per_batch = []
    with torch.no_grad():
        for k in range(ga):
            ix = np.random.default_rng((seed, 0, k)).integers(len(data) - block_size, size=batch_size)
            x = torch.from_numpy(np.stack([data[i:i + block_size] for i in ix]).astype(np.int64))
            y = torch.from_numpy(np.stack([data[i + 1:i + 1 + block_size] for i in ix]).astype(np.int64))
            per_batch.append(gpt(x, y)[1].item())
    return sum(per_batch) / ga, per_batch


@pytest.mark.parametrize("config", ["a", "b"])
def test_logged_loss_is_global_mean(config, runs_a, runs_b, char_data):
    runs, ga = (runs_a, 2) if config == "a" else (runs_b, 4)
    want, per_batch = reference_step0_loss(char_data, ga)
    for name, d in runs.items():
        got = losses(d)[0]
        assert rel(got, want) <= 1e-6, f"{name}: iter 0 loss {got!r}, global mean {want!r}"
        # not rank 0's share: the first micro-batches alone give another mean
        share = sum(per_batch[:ga // 2]) / (ga // 2)
        assert rel(share, want) > 1e-4 and rel(got, share) > 1e-4
    if config == "a":  # two summands: the mean is exact on every backend
        ref = losses(runs["single"])
        for name in BACKENDS_W2:
            assert_bitwise(losses(runs[name]), ref, f"logged loss {name} vs one process")
