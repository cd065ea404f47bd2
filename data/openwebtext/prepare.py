"""
OpenWebText -> train.bin / val.bin of GPT-2 BPE ids (uint16), for train_gpt2.py.

    python data/openwebtext/prepare.py [--dataset openwebtext] [--num_proc 8]

Needs the internet (HuggingFace hub) and ~55GB of disk for the download cache;
the output is ~17GB train.bin + ~8.5MB val.bin.
"""
import argparse
import os
import sys

import numpy as np
from datasets import load_dataset
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # data/, for the helpers the prepare scripts share
from gpt2_bpe import gpt2_encoding  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="openwebtext", help="HuggingFace dataset name, or a local copy's path")
    ap.add_argument("--num_proc", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("--out_dir", default=HERE)
    ap.add_argument("--val_frac", type=float, default=0.0005)
    ap.add_argument("--seed", type=int, default=2357)
    args = ap.parse_args()

    # openwebtext only ships a train split; carve a small val split out of it
    try:
        ds = load_dataset(args.dataset, num_proc=args.num_proc)
    except ConnectionError as e:  # the hub unreachable and the dataset not in the local cache
        raise SystemExit(f"error: {e}; offline, pass --dataset PATH to a local copy")
    split = ds["train"].train_test_split(test_size=args.val_frac, seed=args.seed, shuffle=True)
    split["val"] = split.pop("test")

    enc = gpt2_encoding()

    def tokenize(example):
        ids = enc.encode_ordinary(example["text"])
        # eot marks document boundaries so the model learns where one text ends
        ids.append(enc.eot_token)
        return {"ids": ids, "len": len(ids)}

    tokenized = split.map(tokenize, remove_columns=["text"], desc="tokenizing", num_proc=args.num_proc)

    os.makedirs(args.out_dir, exist_ok=True)
    for name, dset in tokenized.items():
        total = int(np.sum(dset["len"], dtype=np.uint64))
        path = os.path.join(args.out_dir, f"{name}.bin")
        # memmap so the full ~9B-token array never has to sit in RAM
        arr = np.memmap(path, dtype=np.uint16, mode="w+", shape=(total,))
        n_shards = min(1024, len(dset))
        idx = 0
        for i in tqdm(range(n_shards), desc=f"writing {path}"):
            # contiguous shards keep document order; each is concatenated and written at once
            shard = dset.shard(num_shards=n_shards, index=i, contiguous=True).with_format("numpy")
            batch = np.concatenate(shard["ids"]) if len(shard) else np.zeros(0, dtype=np.uint16)
            arr[idx: idx + len(batch)] = batch
            idx += len(batch)
        arr.flush()
        print(f"{name}: {total:,} tokens")


if __name__ == "__main__":
    main()
