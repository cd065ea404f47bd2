"""
fsdp_impl.shm: the shared-memory channels that carry fsdp_impl's exchanges between the ranks of one
host (tests/shm_worker.py at 2 and 3 ranks). That training through them gives FSDP2's bits is
tests/test_fsdp_impl.py's parity suite, which runs on them by default; its `gloo_messages` mode keeps
gloo's messages there.
"""
import json
import os
import sys
import time

import pytest

from conftest import REPO, launch, launcher, losses, run_train

WORKER = REPO / "tests" / "shm_worker.py"
_reports = {}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    def get(world):
        if world not in _reports:
            out = tmp_path_factory.mktemp("shm") / f"w{world}.json"
            res = launch(launcher(world) + [WORKER, out], timeout=240)
            assert res.returncode == 0 and out.exists(), res.describe()
            _reports[world] = json.loads(out.read_text())["ranks"]
        return _reports[world]
    return get


WORLDS = (2, 3)


@pytest.mark.parametrize("world", WORLDS)
def test_streams_arrive_bit_for_bit_and_the_files_are_gone(report, world):
    """Mixed dtypes, empty and one-element tensors, tensors crossing the 1 MB slots' boundaries,
    pieces of one buffer back to back (copied as one), a different length each way, three exchanges
    in a row (the slots are reused); once connected, no rank's channel files are left in /dev/shm."""
    for rank, r in enumerate(report(world)):
        assert r["connected"], (rank, r)
        assert r["bytes_match"] == [True, True, True], (rank, r["bytes_match"])
        assert r["files_left"] == [], (rank, r)


def test_a_forked_child_gets_a_posting_thread_of_its_own():
    """fork copies only the forking thread: the child inherited a posting thread that was not there,
    and its first exchange waited for it for ever (its channels, the parent's, are dropped too)."""
    sys.path.insert(0, str(REPO))
    from fsdp_impl import comm
    if not comm.posting_thread_started():
        comm._poster = comm._PostingThread()
    assert comm._poster.submit(lambda: 1).result(timeout=5) == 1
    pid = os.fork()
    if pid == 0:  # the child exits at once: 0 if its first exchange will start a posting thread of its own
        os._exit(1 if comm.posting_thread_started() else 0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("world", WORLDS)
def test_an_exchange_keeps_no_tensor_once_waited_for(report, world):
    """The posting thread held its last job's tensors until its next one: after backward, the unsharded
    gradients of the last reduce-scatter, through the optimizer step."""
    for rank, r in enumerate(report(world)):
        assert r["freed_after_wait"] == [True, True], (rank, r["freed_after_wait"])


@pytest.mark.parametrize("world", WORLDS)
def test_a_group_keeps_gloo_messages_unless_every_rank_can_share(report, world):
    """One rank with shared_memory off, one on another machine (its peers' files are not there), or
    one whose /dev/shm is full: the whole group keeps gloo's messages, and the files the others
    made are gone."""
    for r in report(world):
        assert r["one_rank_unwilling"] and r["another_machine"] and r["dev_shm_full"], r
        assert r["files_left_after_another_machine"] == [] and r["files_left_after_full"] == [], r


@pytest.mark.parametrize("world", WORLDS)
def test_ranks_that_issue_different_collectives_get_an_error_not_wrong_bytes(report, world):
    """Rank 0 sends 96 floats where its peers expect 100: each peer says so; rank 0 gets what they sent."""
    ranks = report(world)
    assert ranks[0]["size_mismatch"] is True, ranks[0]["size_mismatch"]
    for r in ranks[1:]:
        raised = r["size_mismatch"]
        assert raised["raised"] == "RuntimeError", raised
        assert "rank 0 of the group sent 384 bytes in its exchange 1 (tag 0) where this rank expects 400" \
            in raised["message"]


@pytest.mark.parametrize("world", WORLDS)
def test_collectives_of_different_kinds_and_sizes_alike_are_an_error_not_swapped_bytes(report, world):
    """Rank 0 runs an exchange of another kind (tag) than its peers, of as many bytes: an all-gather
    issued where the peers issued a reduce-scatter of the same unit. Every rank that receives from a
    rank of the other kind says so (gloo's messages keep them apart by tag)."""
    for rank, r in enumerate(report(world)):
        raised = r["other_kind"]
        assert raised["raised"] == "RuntimeError" and "the ranks issued different collectives" in raised["message"], \
            (rank, raised)
        assert ("(tag 2) where this rank expects 384 in its exchange 1 (tag 1)" in raised["message"]) == (rank == 0)


@pytest.mark.parametrize("world", WORLDS)
def test_the_same_bytes_cut_into_other_exchanges_are_an_error_and_the_group_stays_failed(report, world):
    """Rank 0 sends 2 MB and then 1 MB where its peers send and expect one exchange of 3 MB: every slot
    holds 1 MB either way, and the exchange sizes the slots carry tell them apart. After the error the
    channels are out of step, and the next exchange says so at once instead of reading stale slots."""
    for rank, r in enumerate(report(world)):
        raised = r["other_cuts"]
        assert raised["raised"] == "RuntimeError" and "the ranks issued different collectives" in raised["message"], \
            (rank, raised)
        after = r["after_a_failure"]
        assert after["raised"] == "RuntimeError" and "an earlier exchange on this group failed" in after["message"]
        assert r["after_a_failure_s"] < 5.0, r["after_a_failure_s"]  # (the group's timeout is 30 min)


@pytest.mark.parametrize("world", WORLDS)
def test_a_silent_peer_is_an_error_after_the_groups_timeout(report, world):
    for r in report(world):  # (the late rank itself exits in the next scenario and reports nothing)
        raised = r["silent_peer"]
        assert raised["raised"] == "RuntimeError" and "timed out after 2 s waiting for rank" in raised["message"], raised
        assert 2.0 <= r["silent_peer_s"] < 9.9, r["silent_peer_s"]  # (the late rank comes after 10 s)


@pytest.mark.parametrize("world", WORLDS)
def test_a_peer_that_exits_mid_exchange_is_an_error_within_seconds(report, world):
    for r in report(world):
        raised = r["peer_exited"]
        assert raised["raised"] == "RuntimeError", raised
        assert f"rank {world - 1} of the group exited in the middle of an exchange" in raised["message"], raised
        assert r["peer_exited_s"] < 10, r["peer_exited_s"]  # (a second per look; the group's timeout is 30 min)


def test_a_rank_that_raises_with_an_exchange_in_flight_still_exits():
    """Rank 0 raises while an exchange through shared memory waits on its posting thread for rank 1,
    which never joins it. The process must exit (its exit is how the others learn of the failure):
    a thread the interpreter waited for at exit held it until the group's timeout, 30 minutes here."""
    start = time.monotonic()
    res = launch(launcher(2) + [WORKER, "--raise-while-exchanging"], timeout=240)
    assert res.returncode != 0 and "rank 0 failed with an exchange in flight" in res.stderr, res.describe()
    assert time.monotonic() - start < 60, "rank 0 did not exit"


def test_training_through_shared_memory_or_gloo_messages_gives_the_same_bits(tiny_args, tmp_path):
    """custom_fsdp at two ranks: train.py's shared_memory setting changes how the bytes travel (the
    profiled steps show shared-memory transfers, or gloo's sends, and not the other), not what arrives."""
    runs = {}
    for on in (True, False):
        out = tmp_path / f"shm_{on}"
        res = run_train(out, 2, *tiny_args, "--max_iters=5", "--dist_backend=custom_fsdp", f"--shared_memory={on}",
                        "--profile=True")
        assert res.returncode == 0, res.describe()
        runs[on] = losses(out)
        trace = json.loads((out / "traces" / "custom_fsdp" / "rank0.json").read_text())
        names = {e["name"] for e in trace["traceEvents"]}
        assert ("shm:all_gather" in names, "gloo:send" in names) == (on, not on), sorted(names)[:40]
    assert runs[True] == runs[False] and len(runs[True]) >= 5, runs
