"""
Sample from a trained model: any checkpoint, whatever backend and world size wrote it.

    python sample.py --out_dir=out-shakespeare-char --device=cpu
    python sample.py --init_from=gpt2 --start="To be or not"

Reads the newer (saved later) of out_dir/ckpt.pt (see `python checkpoint.py OUT_DIR`) and the
latest checkpoint directory, straight into one unsharded model on one process, and names it on
stderr (stdout holds only the samples). Where one of the two is unreadable it is named there and
the other one read.
"""
import os
import pickle
import sys

import torch

import checkpoint
import configurator
from model import GPT, GPT2_MODELS, GPTConfig, load_pretrained_gpt2


def saved_no_earlier(exported, manifest):
    """Whether an export's checkpoint was saved no earlier than the one `manifest` describes (a tie:
    the same checkpoint, in one file). By save time: a run resumed from an older checkpoint saves
    lower iterations after higher ones. Checkpoints written before save times were recorded: by iteration."""
    if exported.get("saved_at") is not None and manifest.get("saved_at") is not None:
        return exported["saved_at"] >= manifest["saved_at"]
    return exported["iter_num"] >= manifest["iter_num"]


def load_newest(out_dir):
    """(model, training config) from the newer of out_dir/ckpt.pt and the latest checkpoint
    directory: an export goes stale once training continues, so neither simply wins."""
    ckpt_pt = checkpoint.export_path(out_dir)
    has_latest = os.path.exists(os.path.join(out_dir, "latest"))
    exported = None
    if os.path.exists(ckpt_pt):
        try:  # mmap: the weights are read only if this one is used
            exported = torch.load(ckpt_pt, map_location="cpu", mmap=True)
        except (RuntimeError, pickle.UnpicklingError) as e:
            unreadable = f"cannot read {ckpt_pt}: {str(e).splitlines()[0]}"
            if not has_latest:
                raise checkpoint.CheckpointError(unreadable)
            # an export is a copy of a checkpoint directory's weights: that directory's newest is here
            print(f"{unreadable}; reading the latest checkpoint directory instead", file=sys.stderr)
    latest = None
    if exported is None or has_latest:
        try:
            latest = checkpoint.read_manifest(checkpoint.latest_path(out_dir), verify=False)
        except checkpoint.CheckpointError as e:
            if exported is None:
                raise  # (with no ckpt.pt either, this names the missing 'latest')
            print(f"{e}; reading {ckpt_pt} instead, which may be older", file=sys.stderr)
    if exported is not None and (latest is None or saved_no_earlier(exported, latest)):
        model = GPT(GPTConfig(**exported["model_args"]))
        model.load_state_dict(exported["model"])
        path, iter_num, config = ckpt_pt, exported["iter_num"], exported["config"]
    else:
        path, manifest = checkpoint.load_manifest(out_dir)  # verifies the files before loading
        model = GPT(GPTConfig(**manifest["model_args"]))
        checkpoint.load_model_only(path, model)
        iter_num, config = manifest["iter_num"], manifest["config"]
    print(f"loaded {path} (iteration {iter_num})", file=sys.stderr)
    return model, config


init_from = "resume"  # 'resume' (from out_dir) or a GPT-2 variant such as 'gpt2'
out_dir = "out"
start = "\n"  # prompt; "FILE:prompt.txt" reads it from a file
num_samples = 3
max_new_tokens = 300
temperature = 0.8
top_k = 200  # draw from the k likeliest tokens at each step (0: from all)
seed = 1337
data_dir = ""  # the folder of the run's meta.pkl (a character table): '' takes the run's own setting
device = "cuda" if torch.cuda.is_available() else "cpu"
configurator.apply(globals(), sys.argv[1:])
configurator.check_device(device)
for name, fine, need in (("num_samples", num_samples >= 1, "at least 1"), ("max_new_tokens", max_new_tokens >= 0, "at least 0"),
                         ("top_k", top_k >= 0, "at least 0 (0: every token)"),
                         ("temperature", temperature > 0, "positive (top_k=1 takes the likeliest token each time)")):
    if not fine:
        configurator.fail(f"{name}={globals()[name]} must be {need}")

torch.manual_seed(seed)
data_config = {}
if init_from == "resume":
    try:
        model, data_config = load_newest(out_dir)
    except checkpoint.CheckpointError as e:
        configurator.fail(str(e))
elif init_from not in GPT2_MODELS:
    configurator.fail(f"unknown init_from '{init_from}' (choose resume, {', '.join(GPT2_MODELS)})")
else:
    try:
        config, state = load_pretrained_gpt2(init_from)
    except ValueError as e:
        configurator.fail(f"init_from={init_from}: {e}")
    model = GPT(config)
    model.load_state_dict(state)
model.eval().to(device)

# the tokenizer: the dataset's own character table if it has one, else GPT-2's BPE
meta_path = os.path.join(data_dir or data_config.get("data_dir") or os.path.join("data", data_config.get("dataset", "")),
                         "meta.pkl")
if (data_dir or data_config) and os.path.exists(meta_path):
    with open(meta_path, "rb") as f:
        meta = pickle.load(f)
    stoi, itos = meta["stoi"], meta["itos"]

    def encode(s):
        unknown = sorted(set(s) - stoi.keys())
        if unknown:
            configurator.fail(f"--start has characters not in the vocabulary ({meta_path}): {''.join(unknown)!r}")
        return [stoi[c] for c in s]

    decode = lambda ids: "".join(itos[i] for i in ids)
    vocab_size = len(itos)
elif model.config.vocab_size < 50257:  # a character table's model: GPT-2's token ids would not fit
    configurator.fail(f"no {meta_path} (the model's {model.config.vocab_size}-token vocabulary is a character "
                      "table's): run from the folder the training ran in, or pass --data_dir=<its data folder>")
else:
    from data.gpt2_bpe import gpt2_encoding
    enc = gpt2_encoding()
    encode = lambda s: enc.encode(s, allowed_special={"<|endoftext|>"})
    decode = enc.decode
    vocab_size = enc.n_vocab

if start.startswith("FILE:"):
    try:
        with open(start[5:]) as f:
            start = f.read()
    except OSError as e:
        configurator.fail(f"--start: cannot read {start[5:]}: {e.strerror}")
# an empty prompt asks for samples from scratch: start them where a text starts, at a newline (the
# default prompt; both vocabularies here have one, and encode refuses a character table without)
x = torch.tensor(encode(start or "\n"), dtype=torch.long, device=device)[None, ...]
with torch.no_grad():
    for _ in range(num_samples):
        y = model.generate(x, max_new_tokens, temperature=temperature, top_k=top_k or None, vocab_size=vocab_size)
        print(decode(y[0].tolist()))
        print("---------------")
