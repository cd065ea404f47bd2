"""
Tiny Shakespeare tokenized with the GPT-2 BPE (tiktoken), for finetuning GPT-2
checkpoints. No meta.pkl: the vocab is GPT-2's (50257), which train.py assumes.

    python data/shakespeare/prepare.py                 # download if needed
    python data/shakespeare/prepare.py --input PATH    # offline: use a local copy

tiktoken fetches its BPE files on first use; offline, point TIKTOKEN_CACHE_DIR
at a folder that already holds them, or GPT2_BPE_DIR at a folder that holds
GPT-2's vocab.bpe and encoder.json (see data/gpt2_bpe.py).
"""
import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # data/, for the helpers the prepare scripts share
from gpt2_bpe import gpt2_encoding  # noqa: E402
from tinyshakespeare import read_text  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--input", default=None, help="local input.txt (else $SHAKESPEARE_INPUT, else download)")
    ap.add_argument("--out_dir", default=HERE)
    args = ap.parse_args()

    data = read_text(args.input, HERE)
    n = len(data)
    # split the text (not the tokens) 90/10, then tokenize each side on its own
    train_text, val_text = data[: int(n * 0.9)], data[int(n * 0.9):]

    enc = gpt2_encoding()
    # encode_ordinary: treat text like "<|endoftext|>" as plain text, never as a special token
    train_ids = np.array(enc.encode_ordinary(train_text), dtype=np.uint16)  # max id 50256 fits
    val_ids = np.array(enc.encode_ordinary(val_text), dtype=np.uint16)
    print(f"train has {len(train_ids):,} tokens")
    print(f"val has {len(val_ids):,} tokens")

    os.makedirs(args.out_dir, exist_ok=True)
    train_ids.tofile(os.path.join(args.out_dir, "train.bin"))
    val_ids.tofile(os.path.join(args.out_dir, "val.bin"))


if __name__ == "__main__":
    main()
