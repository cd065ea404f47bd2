"""Run the two tiny-Shakespeare prepare scripts on the generated corpus and check their output; the
BPE one reads a tiny GPT-2-format BPE through GPT2_BPE_DIR, so nothing here needs the network."""
import json
import pickle
import sys

import numpy as np
import pytest

from conftest import REPO, TINY_MERGES, launch, make_corpus, write_tiny_bpe


def prepare(name, input_path, out_dir, **env):
    """data/<name>/prepare.py on input_path; GPT2_BPE_DIR only where given (never the caller's)."""
    return launch([sys.executable, REPO / "data" / name / "prepare.py", "--input", input_path, "--out_dir", out_dir],
                  timeout=300, env={"GPT2_BPE_DIR": "", **env})


def test_char_prepare(tmp_path):
    text = make_corpus(tmp_path / "input.txt")
    res = prepare("shakespeare_char", tmp_path / "input.txt", tmp_path)
    assert res.returncode == 0, res.describe()
    train = np.fromfile(tmp_path / "train.bin", dtype=np.uint16)
    val = np.fromfile(tmp_path / "val.bin", dtype=np.uint16)
    with open(tmp_path / "meta.pkl", "rb") as f:
        meta = pickle.load(f)

    # one token per character, split 90/10 by position; the corpus spells tiny Shakespeare's 65 characters
    assert len(train) + len(val) == len(text)
    assert len(train) == int(len(text) * 0.9)
    assert meta["vocab_size"] == len(set(text)) == 65
    assert max(train.max(), val.max()) < meta["vocab_size"]
    assert all(meta["stoi"][meta["itos"][i]] == i for i in range(meta["vocab_size"]))

    itos = meta["itos"]
    assert "".join(itos[int(i)] for i in train[:1000]) == text[:1000]
    assert "".join(itos[int(i)] for i in val) == text[len(train):]


def tiktoken_reference(bpe):
    """The tiny BPE as tiktoken's own loader reads GPT-2's files, with GPT-2's pattern: what
    GPT2_BPE_DIR must reproduce."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str
    ranks = data_gym_to_mergeable_bpe_ranks(str(bpe / "vocab.bpe"), str(bpe / "encoder.json"))
    return tiktoken.Encoding("tiny", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={})


def test_bpe_prepare(tmp_path, monkeypatch):
    text = make_corpus(tmp_path / "input.txt")
    bpe = write_tiny_bpe(tmp_path / "bpe")
    res = prepare("shakespeare", tmp_path / "input.txt", tmp_path / "out", GPT2_BPE_DIR=str(bpe))
    assert res.returncode == 0, res.describe()
    train = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16)
    val = np.fromfile(tmp_path / "out" / "val.bin", dtype=np.uint16)
    assert not (tmp_path / "out" / "meta.pkl").exists()

    # split by text 90/10, each side tokenized as tiktoken tokenizes it; the merges shorten it
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # (tiktoken's loader would cache copies of the files)
    enc = tiktoken_reference(bpe)
    cut = int(len(text) * 0.9)
    assert train.tolist() == enc.encode_ordinary(text[:cut]) and enc.decode(train.tolist()) == text[:cut]
    assert val.tolist() == enc.encode_ordinary(text[cut:]) and enc.decode(val.tolist()) == text[cut:]
    assert len(train) + len(val) < len(text)
    assert max(train.max(), val.max()) < 256 + len(TINY_MERGES)


@pytest.mark.parametrize("damage,named", [
    ("missing", "error: GPT2_BPE_DIR: cannot read "),
    ("mismatched", "encoder.json does not match vocab.bpe"),
    ("not json", "does not hold GPT-2-format vocab.bpe and encoder.json (JSONDecodeError"),
])
def test_bpe_prepare_with_bad_bpe_files_is_one_line(damage, named, tmp_path):
    make_corpus(tmp_path / "input.txt", size=1000)
    bpe = write_tiny_bpe(tmp_path / "bpe")
    if damage == "missing":
        (bpe / "encoder.json").unlink()
    elif damage == "mismatched":  # two merged tokens' ids swapped: tiktoken would merge in another order
        ids = json.loads((bpe / "encoder.json").read_text(encoding="utf-8"))
        ids["Ġt"], ids["Ġa"] = ids["Ġa"], ids["Ġt"]
        (bpe / "encoder.json").write_text(json.dumps(ids), encoding="utf-8")
    else:
        (bpe / "encoder.json").write_text("{", encoding="utf-8")
    res = prepare("shakespeare", tmp_path / "input.txt", tmp_path / "out", GPT2_BPE_DIR=str(bpe))
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: GPT2_BPE_DIR: "), res.describe()
    assert named in lines[0], lines[0]
    assert not (tmp_path / "out" / "train.bin").exists()


def test_bpe_prepare_without_the_bpe_files_is_one_line(tmp_path):
    """Offline with no tiktoken cache (the network refused through a dead proxy): one line saying
    what to set, not requests' traceback."""
    make_corpus(tmp_path / "input.txt", size=1000)
    res = prepare("shakespeare", tmp_path / "input.txt", tmp_path, TIKTOKEN_CACHE_DIR=str(tmp_path / "empty"),
                  HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9")
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0 and len(lines) == 1 and "set TIKTOKEN_CACHE_DIR" in lines[0], res.describe()
    assert "GPT2_BPE_DIR" in lines[0]
    assert not (tmp_path / "train.bin").exists()
