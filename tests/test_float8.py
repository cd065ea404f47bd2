"""train.py --float8=True (torchao's float8 training, emulated on the CPU): custom_fsdp trains to
FSDP2's bits and gathers FSDP2's bytes, DDP trains float8 too, and checkpoints resume across float8,
plain precision and the backends."""
import pytest

import metrics
from conftest import clone_checkpoint, losses, one_error_line, run_train
from test_train import CONFIG_B, CROSS_RESUME, assert_bitwise, assert_close, only, train_ok

FLOAT8 = ["--float8=True"]
# float8 against float32 matmuls on the tiny model: losses 4.16..4.18, apart by at most 2e-4 over
# four steps (measured); 1e-3 tells such a run from a diverged or unloaded one
FLOAT8_VS_PLAIN = 1e-3


@pytest.fixture(scope="module")
def float8_runs(tmp_path_factory, tiny_args):
    """Config B in float8 under FSDP2 and custom_fsdp at W=2 (checkpoints at 4 and 8), and in plain
    precision at one process."""
    base = tmp_path_factory.mktemp("float8")
    out = {b: base / b for b in ("fsdp", "custom_fsdp", "plain")}
    for b in ("fsdp", "custom_fsdp"):
        train_ok(out[b], 2, *tiny_args, *CONFIG_B, *FLOAT8, f"--dist_backend={b}")
    train_ok(out["plain"], None, *tiny_args, *CONFIG_B, "--dist_backend=custom_fsdp")
    return out


def comm_row(out):
    """A run's collectives and bytes per step."""
    return metrics.read(str(out)).comm


def test_custom_fsdp_trains_float8_to_fsdp2s_bits_and_bytes(float8_runs):
    for key in ("loss", "grad_norm"):
        assert_bitwise(losses(float8_runs["custom_fsdp"], key), losses(float8_runs["fsdp"], key), f"float8 {key}")
    assert comm_row(float8_runs["custom_fsdp"]) == comm_row(float8_runs["fsdp"])


def test_a_float8_checkpoint_resumes_under_ddp_and_in_plain_precision(float8_runs, tiny_args, tmp_path):
    """custom_fsdp's float8 checkpoint (plain tensors inside, no torchao class) resumes under DDP in
    float8, as closely as any cross-backend resume (test_train's CROSS_RESUME: W=1 sums the
    micro-steps' losses in another order than W=2's all-reduce, so on some CPUs the logged loss
    rounds one float32 ulp apart, 4.8e-7 at 4.2). And under FSDP2 in plain precision, which gathers
    the Linear weights in four bytes, not one: those weights are 24,576 of the 27,712 elements
    gathered, so float8 gathers about a third of the bytes."""
    writer = float8_runs["custom_fsdp"]
    ddp = clone_checkpoint(writer, 4, tmp_path / "ddp")
    train_ok(ddp, None, *tiny_args, *CONFIG_B, *FLOAT8, "--dist_backend=ddp", "--init_from=resume")
    assert_close(losses(ddp), only(losses(writer), range(4, 8)), CROSS_RESUME,
                 "float8 custom_fsdp W=2 -> float8 ddp W=1")
    plain = clone_checkpoint(writer, 4, tmp_path / "plain")
    train_ok(plain, 2, *tiny_args, *CONFIG_B, "--dist_backend=fsdp", "--init_from=resume")
    assert_close(losses(plain), only(losses(writer), range(4, 8)), FLOAT8_VS_PLAIN, "float8 -> plain fsdp")
    gathered, gathered_float8 = comm_row(plain)["all_gather_bytes"], comm_row(writer)["all_gather_bytes"]
    assert gathered_float8 < 0.4 * gathered, (gathered_float8, gathered)


def test_a_plain_checkpoint_resumes_in_float8(float8_runs, tiny_args, tmp_path):
    """A plain-precision checkpoint resumes in float8 under custom_fsdp at one rank, whose shard is
    each whole weight: the same trajectory within float8's rounding, and not the same bits (the
    matmuls are float8's)."""
    writer = float8_runs["plain"]
    out = clone_checkpoint(writer, 4, tmp_path / "out")
    train_ok(out, None, *tiny_args, *CONFIG_B, *FLOAT8, "--dist_backend=custom_fsdp", "--init_from=resume")
    want = only(losses(writer), range(4, 8))
    assert_close(losses(out), want, FLOAT8_VS_PLAIN, "plain -> float8 custom_fsdp")
    assert losses(out) != want


def test_float8_refuses_widths_its_matmuls_do_not_take(tiny_args, tmp_path):
    res = run_train(tmp_path / "out", None, *tiny_args, *FLOAT8, "--n_embd=40")
    assert one_error_line(res) == "error: float8=True needs n_embd divisible by 16, got 40"
