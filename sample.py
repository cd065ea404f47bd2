"""
Sample from a trained model: any checkpoint, whatever backend and world size wrote it.

    python sample.py --out_dir=out-shakespeare-char --device=cpu
    python sample.py --init_from=gpt2 --start="To be or not"

Reads out_dir/ckpt.pt if present (see `python checkpoint.py OUT_DIR`), else the latest
checkpoint directory, straight into one unsharded model on one process.
"""
import os
import pickle
import sys

import torch

import checkpoint
import configurator
from model import GPT, GPTConfig, load_pretrained_gpt2

init_from = "resume"  # 'resume' (from out_dir) or a GPT-2 variant such as 'gpt2'
out_dir = "out"
start = "\n"  # prompt; "FILE:prompt.txt" reads it from a file
num_samples = 3
max_new_tokens = 300
temperature = 0.8
top_k = 200
seed = 1337
device = "cuda" if torch.cuda.is_available() else "cpu"
configurator.apply(globals(), sys.argv[1:])

torch.manual_seed(seed)
data_config = {}
if init_from == "resume":
    ckpt_pt = os.path.join(out_dir, "ckpt.pt")
    try:
        if os.path.exists(ckpt_pt):
            saved = torch.load(ckpt_pt, map_location="cpu")
            model = GPT(GPTConfig(**saved["model_args"]))
            model.load_state_dict(saved["model"])
            data_config = saved["config"]
        else:
            path, manifest = checkpoint.load_manifest(out_dir)
            model = GPT(GPTConfig(**manifest["model_args"]))
            checkpoint.load_model_only(path, model)
            data_config = manifest["config"]
    except checkpoint.CheckpointError as e:
        raise SystemExit(f"error: {e}")
else:
    config, state = load_pretrained_gpt2(init_from)
    model = GPT(config)
    model.load_state_dict(state, strict=False)
model.eval().to(device)

# the tokenizer: the dataset's own character table if it has one, else GPT-2's BPE
meta_path = os.path.join(data_config.get("data_dir") or os.path.join("data", data_config.get("dataset", "")), "meta.pkl")
if data_config and os.path.exists(meta_path):
    with open(meta_path, "rb") as f:
        meta = pickle.load(f)
    stoi, itos = meta["stoi"], meta["itos"]
    encode = lambda s: [stoi[c] for c in s]
    decode = lambda ids: "".join(itos[i] for i in ids)
else:
    import tiktoken
    enc = tiktoken.get_encoding("gpt2")
    encode = lambda s: enc.encode(s, allowed_special={"<|endoftext|>"})
    decode = enc.decode

if start.startswith("FILE:"):
    with open(start[5:]) as f:
        start = f.read()
x = torch.tensor(encode(start), dtype=torch.long, device=device)[None, ...]
with torch.no_grad():
    for _ in range(num_samples):
        y = model.generate(x, max_new_tokens, temperature=temperature, top_k=top_k)
        print(decode(y[0].tolist()))
        print("---------------")
