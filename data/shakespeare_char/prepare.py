"""
Character-level tiny Shakespeare.

Writes train.bin / val.bin (uint16 token ids) and meta.pkl (the char<->id maps,
which sample.py / train.py need to decode and to know vocab_size).

    python data/shakespeare_char/prepare.py                   # download if needed
    python data/shakespeare_char/prepare.py --input PATH      # offline: use a local copy
"""
import argparse
import os
import pickle
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # data/, for the reader both prepare scripts share
from tinyshakespeare import read_text  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--input", default=None, help="local input.txt (else $SHAKESPEARE_INPUT, else download)")
    ap.add_argument("--out_dir", default=HERE)
    args = ap.parse_args()

    data = read_text(args.input, HERE)
    print(f"dataset length in characters: {len(data):,}")

    # the vocabulary is simply every distinct character; sorted so ids are deterministic
    chars = sorted(set(data))
    vocab_size = len(chars)
    print(f"vocab size: {vocab_size}")
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}

    # plain 90/10 split by position: val is the tail of the play text
    n = len(data)
    train_ids = np.array([stoi[c] for c in data[: int(n * 0.9)]], dtype=np.uint16)
    val_ids = np.array([stoi[c] for c in data[int(n * 0.9):]], dtype=np.uint16)
    print(f"train has {len(train_ids):,} tokens")
    print(f"val has {len(val_ids):,} tokens")

    os.makedirs(args.out_dir, exist_ok=True)
    train_ids.tofile(os.path.join(args.out_dir, "train.bin"))
    val_ids.tofile(os.path.join(args.out_dir, "val.bin"))
    with open(os.path.join(args.out_dir, "meta.pkl"), "wb") as f:
        pickle.dump({"vocab_size": vocab_size, "itos": itos, "stoi": stoi}, f)


if __name__ == "__main__":
    main()
