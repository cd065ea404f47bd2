"""
What only a GPU shows: CPU offload (parameters, gradients and optimizer state in pinned CPU memory),
against FSDP2's, and train.py with it. The CPU machines (and CI) have no CUDA device, so these
tests skip there; they run on the GPU machines lent to some sessions (IMPLEMENTATION.md says when).
"""
import json
import sys

import pytest
import torch

from conftest import REPO, TINY, launch, launcher, losses
from test_train import assert_close, only

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MODES = ["plain", "offload", "offload_bf16", "offload_zero2", "offload_accumulate_synced",
         "offload_accumulate_no_sync", "offload_unit_called_twice", "offload_hsdp", "cpu_built"]


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    out = tmp_path_factory.mktemp("cuda") / "out.json"
    res = launch([sys.executable, REPO / "tests" / "cuda_worker.py", out], timeout=600)
    assert res.returncode == 0, res.describe()
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", MODES)
def test_trains_on_fsdp2s_bits(worker, mode):
    """Same init, same batches, deterministic kernels: the same losses, norms and parameters, bit for bit."""
    record = worker[mode]
    assert "error" not in record, record.get("error")
    assert record["bitwise"], (mode, record["param_max_diff"], record["ours"]["losses"], record["fsdp2"]["losses"])
    for impl in ("ours", "fsdp2"):
        where = record[impl]["where"]
        assert where["moved"], f"{impl}: some parameter did not train"
        expected = ["cpu"] if mode.startswith("offload") else ["cuda"]
        assert where["param"] == expected and where["grad_after_backward"] == expected, (impl, where)


def test_offloaded_copies_run_beside_the_compute_stream(worker):
    """The shards' copies to the GPU and the gradients' copies back run on streams of their own
    (so prefetch can hide them under compute); without offload there are none of either."""
    ours = worker["offload_bf16"]["ours"]["copies"]
    assert ours["h2d_bytes_off_compute"] > 100 * ours["h2d_bytes_on_compute"], ours
    assert ours["d2h_bytes_off_compute"] > 0 and ours["d2h_bytes_on_compute"] == 0, ours
    plain = worker["plain"]["ours"]["copies"]
    assert plain["h2d_bytes_off_compute"] == plain["d2h_bytes_off_compute"] == plain["d2h_bytes_on_compute"] == 0, plain


@pytest.fixture(scope="module")
def data_dir(request):
    """The character-level data: where data/shakespeare_char/prepare.py writes it by default, or
    prepared here from the generated corpus (conftest's char_data)."""
    here = REPO / "data" / "shakespeare_char"
    if (here / "train.bin").exists():
        return here
    return request.getfixturevalue("char_data")


def train_cuda(out, *args):
    res = launch(launcher(None) + [REPO / "train.py", f"--out_dir={out}", "--device=cuda", *args], timeout=300)
    assert res.returncode == 0, res.describe()
    return res


def test_train_py_offloads_checkpoints_and_resumes(data_dir, tmp_path):
    """train.py with --cpu_offload=True under both sharded backends: the same losses (within 1e-5:
    train.py leaves cuDNN and attention to their fastest kernels, not their deterministic ones),
    and a resumed run continues where the whole run went."""
    args = [f"--data_dir={data_dir}", *TINY, "--cpu_offload=True", "--eval_interval=3"]
    runs = {}
    for backend in ("custom_fsdp", "fsdp"):
        runs[backend] = tmp_path / backend
        train_cuda(runs[backend], *args, f"--dist_backend={backend}", "--max_iters=6")
    want = losses(runs["fsdp"])
    assert sorted(want) == list(range(6))
    assert_close(losses(runs["custom_fsdp"]), want, 1e-5, "custom_fsdp vs fsdp, offloaded", relative=True)
    split = tmp_path / "split"
    train_cuda(split, *args, "--dist_backend=custom_fsdp", "--max_iters=3")
    res = train_cuda(split, *args, "--dist_backend=custom_fsdp", "--max_iters=6", "--init_from=resume")
    assert "ckpt-0000003" in res.stdout, res.describe()
    assert_close(only(losses(split), range(3, 6)), only(losses(runs["custom_fsdp"]), range(3, 6)), 1e-5,
                 "custom_fsdp resumed vs whole, offloaded", relative=True)


def test_train_py_offloads_under_compile(data_dir, tmp_path):
    """--compile=True with --cpu_offload=True (each block compiled, the hooks outside the graphs):
    both sharded backends train, checkpoint and agree within 1e-5, as without compile."""
    args = [f"--data_dir={data_dir}", *TINY, "--cpu_offload=True", "--compile=True", "--eval_interval=3",
            "--max_iters=6"]
    runs = {}
    for backend in ("custom_fsdp", "fsdp"):
        runs[backend] = tmp_path / backend
        train_cuda(runs[backend], *args, f"--dist_backend={backend}")
        assert (runs[backend] / "ckpt-0000003").is_dir(), sorted(p.name for p in runs[backend].iterdir())
    want = losses(runs["fsdp"])
    assert sorted(want) == list(range(6))
    assert_close(losses(runs["custom_fsdp"]), want, 1e-5, "custom_fsdp vs fsdp, offloaded and compiled", relative=True)
