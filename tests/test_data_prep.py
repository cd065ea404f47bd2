"""Run the two tiny-Shakespeare prepare scripts on the offline copy and check their output."""
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
INPUT = SHARED / "tinyshakespeare" / "input.txt"
TIKTOKEN_CACHE = SHARED / "tiktoken_cache"

pytestmark = pytest.mark.skipif(not INPUT.exists(), reason=f"offline data not found at {INPUT}")


def run_prepare(name, out_dir):
    env = dict(os.environ)
    if TIKTOKEN_CACHE.exists():
        env["TIKTOKEN_CACHE_DIR"] = str(TIKTOKEN_CACHE)
    script = REPO / "data" / name / "prepare.py"
    res = subprocess.run([sys.executable, str(script), "--input", str(INPUT), "--out_dir", str(out_dir)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return res


def test_char_prepare(tmp_path):
    run_prepare("shakespeare_char", tmp_path)
    text = INPUT.read_text(encoding="utf-8")
    train = np.fromfile(tmp_path / "train.bin", dtype=np.uint16)
    val = np.fromfile(tmp_path / "val.bin", dtype=np.uint16)
    with open(tmp_path / "meta.pkl", "rb") as f:
        meta = pickle.load(f)

    # one token per character, split 90/10 by position
    assert len(train) + len(val) == len(text)
    assert len(train) == int(len(text) * 0.9)
    assert meta["vocab_size"] == len(set(text)) == 65
    assert max(train.max(), val.max()) < meta["vocab_size"]
    assert all(meta["stoi"][meta["itos"][i]] == i for i in range(meta["vocab_size"]))

    itos = meta["itos"]
    assert "".join(itos[int(i)] for i in train[:1000]) == text[:1000]
    assert "".join(itos[int(i)] for i in val) == text[len(train):]


def test_bpe_prepare(tmp_path, monkeypatch):
    if not TIKTOKEN_CACHE.exists():
        pytest.skip("no offline tiktoken cache")
    import tiktoken
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))
    run_prepare("shakespeare", tmp_path)
    text = INPUT.read_text(encoding="utf-8")
    train = np.fromfile(tmp_path / "train.bin", dtype=np.uint16)
    val = np.fromfile(tmp_path / "val.bin", dtype=np.uint16)
    assert not (tmp_path / "meta.pkl").exists()

    # tiny shakespeare is ~338k GPT-2 tokens; the split is by text, so tokens land near 90/10
    total = len(train) + len(val)
    assert 300_000 < total < 380_000
    assert 0.88 < len(train) / total < 0.92
    assert max(train.max(), val.max()) < 50257

    enc = tiktoken.get_encoding("gpt2")
    head = enc.decode(train[:100].tolist())
    assert len(head) > 100 and text.startswith(head)
    assert enc.decode(val.tolist()) == text[int(len(text) * 0.9):]


def test_bpe_prepare_without_the_bpe_files_is_one_line(tmp_path):
    """Offline with no tiktoken cache (the network refused through a dead proxy): one line saying
    what to set, not requests' traceback."""
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty"), "HTTPS_PROXY": "http://127.0.0.1:9",
           "HTTP_PROXY": "http://127.0.0.1:9"}
    res = subprocess.run([sys.executable, str(REPO / "data" / "shakespeare" / "prepare.py"), "--input", str(INPUT),
                          "--out_dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0 and len(lines) == 1 and "set TIKTOKEN_CACHE_DIR" in lines[0], res.stderr
    assert not (tmp_path / "train.bin").exists()
