"""
What train.py runs, as importable code: its settings with their defaults, the checks on them, the
vocabulary it gives a new model, and one training step. plan.py plans the same step, so the plan
is of what train.py runs.
"""
import os
import pickle
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist

import configurator
from backends import BACKENDS
from model import GPT2_MODELS

GPT2_VOCAB = 50257  # GPT-2's BPE: the data's vocabulary unless its meta.pkl names another
GPT2_VOCAB_PADDED = 50304  # the BPE padded to a multiple of 64: faster matmuls


def defaults():
    """train.py's settings and their defaults, each local variable below one, in the order --help
    lists them. train.py makes them its globals; config files and --key=value override them
    (configurator.py)."""
    # default config: a small char-level model on tiny Shakespeare
    # I/O
    out_dir = "out"
    eval_interval = 250
    eval_iters = 20  # batches per split in each evaluation; 0 skips it (and saves at every eval_interval)
    log_interval = 10
    eval_only = False  # evaluate the model as loaded (scratch, resume or gpt2) once, and exit
    always_save_checkpoint = True  # else only when the validation loss improves
    keep_checkpoints = 2  # complete checkpoints kept in out_dir; 0 saves none (bench.py's runs)
    init_from = "scratch"  # 'scratch', 'resume' (the latest checkpoint in out_dir), or OpenAI's 'gpt2' (-medium, ...)
    # wandb logging
    wandb_log = False
    wandb_project = "fsdp-gpt"
    wandb_run_name = "run"  # runs are named <run_name>-<backend>-w<world size> and grouped by run_name
    # data
    dataset = "shakespeare_char"
    data_dir = ""  # default: data/<dataset>
    gradient_accumulation_steps = 4  # global micro-batches per step, split across processes
    batch_size = 12  # sequences per micro-batch
    block_size = 64
    seed = 1337
    # model
    n_layer = 4
    n_head = 4
    n_embd = 128
    dropout = 0.0
    bias = False
    # AdamW
    learning_rate = 1e-3
    max_iters = 2000
    weight_decay = 1e-1
    beta1 = 0.9
    beta2 = 0.99
    grad_clip = 1.0  # 0 disables clipping (the norm is still measured and logged)
    # learning rate schedule: linear warmup, cosine decay to min_lr
    decay_lr = True
    warmup_iters = 100
    lr_decay_iters = 2000
    min_lr = 1e-4
    # distributed
    dist_backend = "ddp"  # 'ddp', 'fsdp' (PyTorch FSDP2) or 'custom_fsdp' (ours)
    backend = "nccl"  # process-group backend on CUDA; CPU runs use gloo
    # FSDP knobs (fsdp and custom_fsdp)
    reshard_after_forward = True  # True: ZeRO-3 (free gathered params after forward); False: ZeRO-2
    wrap_policy = "size"  # 'size': consecutive blocks per unit up to min_wrap_params; 'block': one each; 'model'
    min_wrap_params = 20_000_000  # wrap_policy='size': a unit takes blocks until it holds this many parameters
    prefetch = True  # gather the next unit while this one computes (False under fsdp: in forward only)
    reshard_after_backward = True  # False: units stay gathered between accumulation micro-steps, freed after the last
    replicate_degree = 1  # HSDP: >1 replicates over this many groups and shards inside each
    cpu_offload = False  # keep sharded params, grads and optimizer state in CPU memory (CUDA only)
    activation_checkpointing = False  # recompute each block's activations in backward (any backend)
    # failures
    dist_timeout_s = 600  # a collective waiting longer than this aborts the job instead of hanging
    on_nonfinite = "stop"  # non-finite loss or grad norm: 'stop' (exit, naming the iteration) or 'skip' the step
    max_skipped_steps = 10  # on_nonfinite='skip': stop after more steps than this skipped in a row
    # system
    device = "cuda" if torch.cuda.is_available() else "cpu"  # 'cpu', 'cuda', 'cuda:0', ...
    dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    compile = False
    float8 = False  # torchao's float8 matmuls in every Linear but the output head; fsdp backends gather them in float8
    deterministic = False  # deterministic kernels (math attention, cuBLAS's): backends agree bit for bit on a GPU
    # observability (see observe.py)
    profile = False  # Chrome traces of a few steps under out_dir/traces/<dist_backend>/
    memory_snapshot = False  # CUDA memory history of a few steps (CPU: their allocations, in a trace)
    return dict(locals())


def settings(argv):
    """The settings after config files and --key=value args, as train.py takes them (bad input exits
    in one line)."""
    return configurator.apply(defaults(), argv)


def creatable(path):
    """Whether directory `path` exists writable, or its nearest existing ancestor can hold it."""
    while not os.path.lexists(path):
        path = os.path.dirname(os.path.abspath(path))
    return os.path.isdir(path) and os.access(path, os.W_OK)


def problem(s):
    """What train.py refuses in settings `s` before it starts (out_dir's place on disk included), in
    one line; None if nothing."""
    device = configurator.device_problem(s["device"])
    if device:
        return device
    if s["backend"] not in ("nccl", "gloo"):
        hint = f": for the distributed trainer, --dist_backend={s['backend']}" if s["backend"] in BACKENDS else ""
        return f"unknown backend '{s['backend']}' (the process group's: nccl or gloo{hint})"
    if s["init_from"] not in ("scratch", "resume", *GPT2_MODELS):
        return f"unknown init_from '{s['init_from']}' (choose scratch, resume, {', '.join(GPT2_MODELS)})"
    if s["on_nonfinite"] not in ("stop", "skip"):
        return f"unknown on_nonfinite '{s['on_nonfinite']}' (choose stop or skip)"
    if s["keep_checkpoints"] < 0:
        return f"keep_checkpoints={s['keep_checkpoints']} is negative (0 saves no checkpoints)"
    if s["eval_iters"] < 0:
        return f"eval_iters={s['eval_iters']} is negative (0 skips evaluation)"
    if s["eval_only"] and not s["eval_iters"]:
        return "eval_only=True needs eval_iters > 0"
    for name in ("batch_size", "block_size", "gradient_accumulation_steps", "eval_interval", "log_interval",
                 "n_layer", "n_head", "n_embd", "dist_timeout_s"):
        if s[name] < 1:
            return f"{name}={s[name]} must be at least 1"
    for name in ("max_iters", "warmup_iters", "learning_rate", "min_lr", "weight_decay", "grad_clip",
                 "max_skipped_steps", "min_wrap_params"):
        if s[name] < 0:  # (grad_clip=-1, say, would train unclipped, silently)
            return f"{name}={s[name]} is negative"
    for name in ("dropout", "beta1", "beta2"):
        if not 0 <= s[name] < 1:
            return f"{name}={s[name]} is outside [0, 1)"
    if s["float8"] and s["n_embd"] % 16:  # (float8 matmuls take dimensions in multiples of 16)
        return f"float8=True needs n_embd divisible by 16, got {s['n_embd']}"
    if s["n_embd"] % s["n_head"]:
        return f"n_embd={s['n_embd']} is not divisible by n_head={s['n_head']}"
    if not 0 <= s["seed"] < 2**44:  # (the initialization draws from seeds of 64 bits made from it: model.py)
        return (f"seed={s['seed']} is outside 0..2**44-1 (the data, the initialization and dropout derive their "
                "seeds from it)")
    if s["decay_lr"] and not (s["warmup_iters"] < s["lr_decay_iters"] and s["min_lr"] <= s["learning_rate"]):
        return (f"the learning-rate schedule needs warmup_iters < lr_decay_iters and min_lr <= learning_rate "
                f"(got {s['warmup_iters']}, {s['lr_decay_iters']}, {s['min_lr']}, {s['learning_rate']})")
    out_dir = s["out_dir"]
    if not out_dir:
        return "out_dir is empty: name a directory ('.' for this one)"
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        return f"out_dir {out_dir} is a file, not a directory"
    if not creatable(out_dir):  # (created before the first write, so a refused run leaves nothing behind)
        return f"out_dir {out_dir} is not writable"
    return None


def data_folder(s):
    """Where the dataset lives: data_dir, else data/<dataset>."""
    return s["data_dir"] or os.path.join("data", s["dataset"])


def data_vocab(folder):
    """The data's vocabulary (its token ids are below it): meta.pkl's, else GPT-2's BPE."""
    path = os.path.join(folder, "meta.pkl")
    if not os.path.exists(path):
        return GPT2_VOCAB
    with open(path, "rb") as f:
        return pickle.load(f)["vocab_size"]


def new_model_vocab(vocab):
    """The vocabulary of a model made from scratch for data of `vocab` tokens: GPT-2's BPE padded."""
    return GPT2_VOCAB_PADDED if vocab == GPT2_VOCAB else vocab


def vocab_size(s):
    """The vocabulary of the model train.py makes from scratch with settings `s`."""
    return new_model_vocab(data_vocab(data_folder(s)))


def seed_dropout(s, *key):
    """Seed the generator dropout draws from by (seed, *key), as train.py's batches are drawn, in a
    stream of its own (spawn_key: not the bits the batch's generator starts from): the CPU's, and
    the GPU's on CUDA. (torch.manual_seed would also queue a seed, with a formatted stack, for every
    device type not yet in use, costing host time at each micro-step.)"""
    seed = int(np.random.SeedSequence((s["seed"], *key), spawn_key=(1,)).generate_state(1, np.uint64)[0])
    torch.default_generator.manual_seed(seed)
    if s["device"].startswith("cuda"):
        torch.cuda.manual_seed(seed)  # (this process's GPU, in use by now: seeded at once)


def train_step(s, back, model, optimizer, local_steps, batch, iter_num, rank, timed=lambda phase: nullcontext(),
               mark=lambda where: None, update=lambda loss_sum, grad_norm: True, before_zero_grad=lambda: None):
    """One optimizer step over the global batch, as train.py takes it and plan.py plans it. Rank
    `rank` runs its `local_steps` micro-batches, batch(iter_num, k) for global micro-batch k, with
    gradients communicated on the last one only; then the loss is summed over the global batch,
    the gradients clipped, the optimizer steps (or skips, when update(loss_sum, grad_norm) says
    so), before_zero_grad() runs, and zero_grad frees the gradients. timed(phase) wraps what
    train.py times per phase; mark(where) names each moment for plan.py's counter."""
    loss_sum = torch.zeros((), device=s["device"])
    for micro_step in range(local_steps):
        k = rank * local_steps + micro_step  # global micro-batch index
        mark(f"forward {micro_step}")  # (the batch is the forward's: its tokens live to the step's end)
        with timed("batch"):
            X, Y = batch(iter_num, k)
        with timed("forward_backward"):
            if s["dropout"]:  # (host time per micro-step: not paid where nothing draws)
                seed_dropout(s, iter_num, k)  # dropout masks, fixed like the data
            back.set_grad_sync(model, micro_step == local_steps - 1)
            with back.autocast():
                # [1]: keep the loss, drop the logits (at GPT-2 size 1.2 GB that would otherwise
                # stay alive through the next micro-step's forward)
                loss = model(X, Y)[1] / local_steps  # mean over this rank's micro-batches; ranks average grads
            mark(f"backward {micro_step}")
            back.backward(loss)
            loss_sum += loss.detach()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(loss_sum)  # exact mean over the global batch, not rank 0's share
    mark("clip")
    with timed("clip"):
        grad_norm = back.clip_grad_norm(optimizer, s["grad_clip"])
    mark("optimizer")
    if update(loss_sum, grad_norm):
        with timed("optimizer"):
            back.step(optimizer)
    else:
        back.skip_step(optimizer)
    before_zero_grad()
    mark("zero_grad")
    optimizer.zero_grad(set_to_none=True)
    mark("between steps")
