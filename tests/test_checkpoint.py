"""checkpoint.py in this process, on a tiny plain model (no process group, as DDP at one process):
what a manifest must hold to be read, the checksums, the `latest` pointer, pruning, which intact
checkpoint an error names, what a save and load carry of the optimizer, and the export. (The
backends, world sizes and crashes: test_train.py and test_failures.py, through train.py.)"""
import json
import os
import runpy
import shutil
import sys

import pytest
import torch

from conftest import REPO

sys.path.insert(0, str(REPO))
import checkpoint  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

MODEL_ARGS = dict(n_layer=1, n_head=2, n_embd=16, block_size=8, bias=False, vocab_size=32, dropout=0.0)


def trained_gpt(steps, weight_decay=0.1, betas=(0.9, 0.95)):
    """The tiny GPT and train.py's AdamW after `steps` steps on one fixed batch."""
    gpt = GPT(GPTConfig(**MODEL_ARGS))
    gpt.init_weights(0)
    opt = gpt.configure_optimizers(weight_decay, 1e-2, betas)
    x = torch.randint(0, MODEL_ARGS["vocab_size"], (2, MODEL_ARGS["block_size"]),
                      generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        gpt(x, x)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return gpt, opt


def save(out, it, gpt, opt, keep=2):
    meta = dict(iter_num=it, best_val_loss=1.5, model_args=MODEL_ARGS, config={"seed": 7})
    checkpoint.save(str(out), gpt, opt, meta, keep=keep)
    return out / f"ckpt-{it:07d}"


@pytest.fixture
def saved(tmp_path):
    """out_dir holding one checkpoint, of iteration 3 after three steps: (out_dir, its directory, gpt, optimizer)."""
    gpt, opt = trained_gpt(3)
    return tmp_path, save(tmp_path, 3, gpt, opt), gpt, opt


def test_load_restores_every_optimizer_tensor_and_keeps_this_runs_settings(saved):
    """Each parameter's moments and step count land on that parameter (by name); weight decay and
    betas stay this run's, per group (the matrices decay, the gains do not)."""
    _, ckpt, gpt, opt = saved
    fresh, fresh_opt = trained_gpt(0, weight_decay=0.5, betas=(0.5, 0.6))
    checkpoint.load(str(ckpt), fresh, fresh_opt)
    params = dict(fresh.named_parameters())
    for name, p in gpt.named_parameters():
        assert torch.equal(params[name], p), name
        want, got = opt.state[p], fresh_opt.state[params[name]]
        assert sorted(got) == sorted(want) == ["exp_avg", "exp_avg_sq", "step"], name
        for key in want:
            assert torch.equal(got[key], want[key]), (name, key)
    assert [(g["weight_decay"], g["betas"]) for g in fresh_opt.param_groups] == [(0.5, (0.5, 0.6)), (0.0, (0.5, 0.6))]


def flip_byte(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_every_file_is_checksummed_over_all_of_it(saved, tmp_path_factory):
    """DCP's own .metadata (a dot file) is checked like the shards; a file longer than one 16 MB
    read is checked over every read, not the last one alone."""
    _, ckpt, _, _ = saved
    flip_byte(ckpt / ".metadata", 10)
    with pytest.raises(checkpoint.CheckpointError, match=r"is corrupt: \.metadata has"):
        checkpoint.read_manifest(str(ckpt))
    big = tmp_path_factory.mktemp("big")
    (big / "__0_0.distcp").write_bytes(bytes(17 << 20))
    (big / "manifest.json").write_text(json.dumps(dict(format_version=checkpoint.FORMAT_VERSION, iter_num=1,
        best_val_loss=1.0, model_args=MODEL_ARGS, config={}, files=checkpoint._file_digests(big))))
    checkpoint.read_manifest(str(big))
    flip_byte(big / "__0_0.distcp", 100)  # in the first 16 MB
    with pytest.raises(checkpoint.CheckpointError, match=r"is corrupt: __0_0\.distcp has"):
        checkpoint.read_manifest(str(big))


# an edit of a good manifest -> what the one-line refusal says
BAD_MANIFESTS = {
    "no_version": (lambda m: m.pop("format_version"), "format version None; this code reads 1"),
    "older_version": (lambda m: m.update(format_version=0), "format version 0; this code reads 1"),
    "iter_num_text": (lambda m: m.update(iter_num="3"), "'iter_num' is missing or of the wrong type"),
    "best_val_loss_text": (lambda m: m.update(best_val_loss="1.5"), "'best_val_loss' is missing or of the wrong"),
    "config_a_list": (lambda m: m.update(config=[]), "'config' is missing or of the wrong type"),
    "files_entry_without_crc": (lambda m: next(iter(m["files"].values())).pop("crc32"), "a 'files' entry is not"),
    "model_args_without_vocab_size": (lambda m: m["model_args"].pop("vocab_size"), "'model_args' lacks vocab_size"),
}


@pytest.mark.parametrize("damage", BAD_MANIFESTS)
def test_a_manifest_of_another_version_or_with_a_wrong_field_is_refused(saved, damage):
    """(Each reader would otherwise fail later in a traceback: comparing a text iteration with
    max_iters, building a model without a vocabulary, formatting a missing crc32.)"""
    _, ckpt, _, _ = saved
    edit, named = BAD_MANIFESTS[damage]
    manifest = json.loads((ckpt / "manifest.json").read_text())
    edit(manifest)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointError, match="has a corrupt manifest.json|format version") as e:
        checkpoint.read_manifest(str(ckpt))
    assert named in str(e.value), str(e.value)


@pytest.mark.parametrize("text", [b"{not json", b"\xff\xfe{}"], ids=["not_json", "not_utf8"])
def test_an_unreadable_manifest_is_refused(saved, text):
    _, ckpt, _, _ = saved
    (ckpt / "manifest.json").write_bytes(text)
    with pytest.raises(checkpoint.CheckpointError, match="has a corrupt manifest.json"):
        checkpoint.read_manifest(str(ckpt))


def test_a_manifest_that_is_a_directory_a_latest_that_is_not_text_and_an_unreadable_file_are_named(saved, monkeypatch):
    """Each was a traceback (on rank 0, with the other ranks waiting for its answer)."""
    out, ckpt, _, _ = saved
    (out / "latest").write_bytes(b"\xff\xfe")
    with pytest.raises(checkpoint.CheckpointError, match="latest is corrupt"):
        checkpoint.load_manifest(str(out))
    (out / "latest").write_text(ckpt.name)

    def unreadable(path):
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr(checkpoint, "_file_digests", unreadable)
    with pytest.raises(checkpoint.CheckpointError, match=f"cannot read the checkpoint in {out}: .*Permission denied"):
        checkpoint.load_manifest(str(out))
    monkeypatch.undo()
    (ckpt / "manifest.json").unlink()
    (ckpt / "manifest.json").mkdir()
    with pytest.raises(checkpoint.CheckpointError, match="has a corrupt manifest.json"):
        checkpoint.load_manifest(str(out))


def test_a_save_cut_before_its_directory_takes_the_name_leaves_a_whole_checkpoint_named(saved, monkeypatch):
    """A crash (a failing rename here) before a new iteration's directory takes its name: `latest`
    still names the one before. Before a re-saved iteration's does: its old copy, set aside as
    .old, is what `latest` leads to."""
    out, ckpt, gpt, opt = saved
    rename = os.rename

    def cut(src, dst):
        if os.path.basename(src).startswith("ckpt-") and src.endswith(".tmp"):
            raise OSError("cut")
        rename(src, dst)
    monkeypatch.setattr(os, "rename", cut)
    for it in (4, 3):
        with pytest.raises(OSError, match="cut"):
            save(out, it, gpt, opt)
        assert (out / "latest").read_text() == ckpt.name
    path = checkpoint.latest_path(str(out))
    assert path == f"{ckpt}.old"
    checkpoint.read_manifest(path)


def test_latest_written_by_hand_with_a_newline_and_a_leftover_old_copy(saved):
    """`echo ckpt-... > latest` (as an error advises writing the name there) ends in a newline; a
    crash after a re-saved iteration took its name, before its .old copy went, leaves both: the new one counts."""
    out, ckpt, _, _ = saved
    (out / "latest").write_text(ckpt.name + "\n")
    assert checkpoint.latest_path(str(out)) == str(ckpt)
    shutil.copytree(ckpt, out / (ckpt.name + ".old"))
    assert checkpoint.latest_path(str(out)) == str(ckpt)


def test_an_old_copy_counts_among_the_kept_checkpoints_and_goes_once_replaced(saved):
    """A .old left by a crash in the re-save of its iteration is that iteration's checkpoint (a
    resume loads it): pruning keeps it or removes it like any other. One left beside the copy that
    replaced it goes at the next save."""
    out, ckpt, gpt, opt = saved
    os.rename(ckpt, f"{ckpt}.old")
    names = lambda: sorted(p.name for p in out.glob("ckpt-*"))  # noqa: E731
    save(out, 5, gpt, opt)
    assert names() == ["ckpt-0000003.old", "ckpt-0000005"]
    save(out, 6, gpt, opt)
    assert names() == ["ckpt-0000005", "ckpt-0000006"]
    shutil.copytree(out / "ckpt-0000006", out / "ckpt-0000006.old")
    save(out, 7, gpt, opt)
    assert names() == ["ckpt-0000006", "ckpt-0000007"]


def test_pruning_leaves_what_is_not_a_checkpoint_of_its_own(saved):
    """A user's copy of a checkpoint under another name, and a file named like one, are not
    pruned (they were: the copy removed, the file an error after the save)."""
    out, ckpt, gpt, opt = saved
    shutil.copytree(ckpt, out / (ckpt.name + "-good"))
    (out / "ckpt-notes").write_text("")
    for it in (4, 5):
        save(out, it, gpt, opt, keep=1)
    assert sorted(p.name for p in out.glob("ckpt-*")) == ["ckpt-0000003-good", "ckpt-0000005", "ckpt-notes"]


def test_keeping_more_than_were_saved_prunes_none_and_the_newest_intact_one_is_named(tmp_path):
    gpt, opt = trained_gpt(1)
    for it in (1, 2, 3, 4):
        save(tmp_path, it, gpt, opt, keep=5)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == [f"ckpt-000000{i}" for i in (1, 2, 3, 4)]
    shard = next((tmp_path / "ckpt-0000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load_manifest(str(tmp_path))
    assert f"{tmp_path / 'ckpt-0000003'} is intact" in str(e.value), str(e.value)  # not an older one


def test_export_carries_the_manifest_and_its_save_time(saved, monkeypatch):
    """`python checkpoint.py OUT_DIR`: the weights and what the manifest says, saved_at included:
    sample.py takes the newer of ckpt.pt and `latest` by it, and a checkpoint saved while the export
    ran (training goes on) is newer than the one exported."""
    out, ckpt, gpt, _ = saved
    monkeypatch.setattr(sys, "argv", ["checkpoint.py", str(out)])
    runpy.run_path(str(REPO / "checkpoint.py"), run_name="__main__")
    exported = torch.load(out / "ckpt.pt", map_location="cpu", weights_only=False)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for key in ("iter_num", "best_val_loss", "model_args", "config", "saved_at"):
        assert exported[key] == manifest[key], key
    assert exported["model"].keys() == gpt.state_dict().keys()
    assert all(torch.equal(exported["model"][k], v) for k, v in gpt.state_dict().items())
