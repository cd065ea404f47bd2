"""
Train a GPT, on one process or many, with the distributed backend of your choice.

One process:               python train.py config/train_shakespeare_char.py --device=cpu
Several (one node):        torchrun --standalone --nproc_per_node=4 train.py config/... --dist_backend=custom_fsdp
Several nodes:             see README.md (torchrun rendezvous or scripts/slurm.sh)

--dist_backend: ddp (DistributedDataParallel), fsdp (PyTorch's FSDP2), custom_fsdp (ours, fsdp_impl/).
Every difference between them lives in backends.py; this loop never asks which one it has.
"""
import functools
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import checkpoint
import configurator
import metrics
import observe
import training
from backends import BackendError, init_distributed, make_backend, use_deterministic_kernels
from model import GPT, GPTConfig, load_pretrained_gpt2

# the settings, as plain globals: training.defaults() lists them with their defaults; config files
# and --key=value override them (configurator.py)
globals().update(training.defaults())
config = configurator.apply(globals(), sys.argv[1:])  # (the settings, as checkpoints and wandb record them)

master = int(os.environ.get("RANK", 0)) == 0  # torchrun's rank, before the process group exists
wandb_run = None


def leave(code, msg=None):
    """Print msg (from rank 0), close wandb and the process group, and exit with code."""
    if master and msg:
        print(msg, flush=True)
    if wandb_run is not None:
        wandb_run.finish(exit_code=code)  # (the exit below skips wandb's own teardown, which would flush the run)
    if dist.is_initialized():
        dist.destroy_process_group()
    # FSDP2 on gloo can abort in interpreter teardown after a clean run; we are done, so leave now
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def fail(msg):
    """Bad input: one line naming the problem, non-zero exit, nothing overwritten."""
    configurator.report_error(msg)
    leave(2)


def checkpoints_kept():
    """What a stop for non-finite numbers leaves, for its error line."""
    if checkpoint.holds_checkpoints(out_dir):
        return f"the last checkpoint in {out_dir} is untouched"
    return f"{out_dir} holds no checkpoint yet"


problem = training.problem(config)
if problem:
    fail(problem)
# distributed setup: torchrun sets RANK/WORLD_SIZE; a plain `python train.py` is one process
rank, world_size, device = init_distributed(dist_backend, backend, device, dist_timeout_s)
config["device"] = device
try:
    back = make_backend(dist_backend, config)
except BackendError as e:
    fail(str(e))
if gradient_accumulation_steps % world_size and not eval_only:  # (eval_only trains nothing)
    fail(f"gradient_accumulation_steps={gradient_accumulation_steps} is not divisible by the world size {world_size}")
local_steps = gradient_accumulation_steps // world_size  # micro-batches on this rank per step
tokens_per_iter = gradient_accumulation_steps * batch_size * block_size
if master:
    print(f"{dist_backend} on {world_size} process(es); tokens per iteration: {tokens_per_iter:,}")
    if back.note:
        print(back.note)
device_type = "cuda" if device.startswith("cuda") else "cpu"
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
if deterministic:  # for comparing backends, not for speed
    use_deterministic_kernels()

# data: the batch of (iteration i, global micro-batch k) depends on (seed, i, k) alone, so every
# world size and backend trains on the same tokens, and a resumed run on the same as an unbroken one
data_dir = training.data_folder(config)
data_files = {}  # split -> (open file descriptor, tokens)
for split in ("train", "val"):
    path = os.path.join(data_dir, f"{split}.bin")
    if not os.path.exists(path):
        fail(f"no {split}.bin in {data_dir}: run python data/{dataset or '<dataset>'}/prepare.py first")
    tokens = os.path.getsize(path) // 2  # (uint16)
    if tokens <= block_size:
        fail(f"{split}.bin in {data_dir} has {tokens:,} tokens: too few for block_size={block_size}")
    data_files[split] = (os.open(path, os.O_RDONLY), tokens)


def get_batch(split, *key):
    # each row one read of block_size + 1 tokens (x and y overlap): a np.memmap kept open would count
    # every page it ever touched in the process's RSS (in time all of OpenWebText's 17 GB), and one
    # opened per call, as nanoGPT's, costs twice the host time
    fd, tokens = data_files[split]
    ix = np.random.default_rng((seed, *key)).integers(tokens - block_size, size=batch_size)
    rows = np.stack([np.frombuffer(os.pread(fd, 2 * (block_size + 1), 2 * int(i)), dtype=np.uint16) for i in ix])
    x, y = torch.from_numpy(rows[:, :-1].astype(np.int64)), torch.from_numpy(rows[:, 1:].astype(np.int64))
    if device_type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x, y


# model
iter_num, best_val_loss = 0, 1e9
model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, bias=bias,
                  vocab_size=None, dropout=dropout, activation_checkpointing=activation_checkpointing)
pretrained, pretrained_from = None, None  # the GPT-2 model a run started from sets its shape, not the config


def torchrun_job():
    """This torchrun job's name, the same in each of its restarts (None outside torchrun): its
    --rdzv_id (--standalone draws one). Jobs launched without one all share the id `none`; for them
    the folder torchrun made for this launch's logs stands in, rank 0's, kept through the restarts."""
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")  # <launch's folder>/attempt_<n>/<local rank>/error.json
    if job != "none" or not error_file:  # (none with --log_dir=/dev/null: such a job resumes what it finds)
        return job
    name = ["none:" + os.path.dirname(os.path.dirname(os.path.dirname(error_file)))]
    if world_size > 1:
        dist.broadcast_object_list(name, src=0)  # (each node has a folder of its own)
    return name[0]


# torchrun restarted us after a failure: continue from the last checkpoint, if this job saved one
# there (its first attempt may have been refused for another run's checkpoints)
job = torchrun_job()
if init_from != "resume" and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0 \
        and checkpoint.holds_checkpoints(out_dir) \
        and (job == "none" or checkpoint.saved_by(out_dir, job)):  # (no `latest`: the resume says what to mend)
    init_from = "resume"
    if master:
        print(f"restart {os.environ['TORCHELASTIC_RESTART_COUNT']}: resuming from the last checkpoint")
if init_from != "resume" and not eval_only:  # a new run: out_dir must not hold another run's
    if checkpoint.holds_checkpoints(out_dir):
        fail(f"{out_dir} holds another run's checkpoints, which a new run there would replace (and start its "
             "metrics.jsonl afresh): continue it with --init_from=resume, or choose another out_dir")
    if os.path.exists(checkpoint.export_path(out_dir)):
        fail(f"{out_dir} holds another run's exported model ({checkpoint.EXPORT}): a new run there would mix its "
             "checkpoints and metrics with that run's; choose another out_dir")
data_vocab = training.data_vocab(data_dir)  # the data's token ids are below this
if init_from == "scratch":
    model_args["vocab_size"] = training.new_model_vocab(data_vocab)
elif init_from == "resume":
    try:
        ckpt_path, manifest = checkpoint.load_manifest(out_dir)
    except checkpoint.CheckpointError as e:
        fail(str(e))
    # the architecture must be the checkpoint's (for a run from GPT-2: GPT-2's, whatever the config
    # says); dropout and checkpointing may change on resume
    pretrained_from = manifest.get("pretrained_from")
    for k in ("n_layer", "n_head", "n_embd", "block_size", "bias"):
        if pretrained_from and k != "block_size":
            model_args[k] = manifest["model_args"][k]
        elif manifest["model_args"][k] != model_args[k]:
            fail(f"checkpoint {ckpt_path} has {k}={manifest['model_args'][k]} but this run asks {k}={model_args[k]}")
    model_args["vocab_size"] = manifest["model_args"]["vocab_size"]
    if data_vocab > model_args["vocab_size"]:
        fail(f"checkpoint {ckpt_path} has a vocabulary of {model_args['vocab_size']} tokens, smaller than "
             f"the {data_vocab} of the data in {data_dir}: resume on the dataset it was trained on")
    if manifest["iter_num"] >= max_iters and not eval_only:  # a finished run (also after a late restart)
        leave(0, f"checkpoint {ckpt_path} is at iteration {manifest['iter_num']} and max_iters={max_iters}: "
                 "nothing to train (raise --max_iters to continue)")
else:  # OpenAI's GPT-2 weights
    try:
        gptconf, pretrained = load_pretrained_gpt2(init_from)
    except ValueError as e:
        fail(f"init_from={init_from}: {e}")
    pretrained_from = init_from
    if master and (n_layer, n_head, n_embd, bias) != (gptconf.n_layer, gptconf.n_head, gptconf.n_embd, True):
        print(f"{init_from} has {gptconf.n_layer} layers, {gptconf.n_head} heads, {gptconf.n_embd} wide, with "
              f"biases: this run's n_layer, n_head, n_embd and bias do not apply")
    if block_size > gptconf.block_size:
        fail(f"block_size={block_size} is larger than {init_from}'s {gptconf.block_size} positions")
    if data_vocab > gptconf.vocab_size:
        fail(f"{init_from} has a vocabulary of {gptconf.vocab_size} tokens, smaller than the {data_vocab} "
             f"of the data in {data_dir}")
    pretrained["transformer.wpe.weight"] = pretrained["transformer.wpe.weight"][:block_size]  # fewer positions
    model_args.update(n_layer=gptconf.n_layer, n_head=gptconf.n_head, n_embd=gptconf.n_embd,
                      vocab_size=gptconf.vocab_size, bias=True)


def materialize(m):
    """Give the (possibly sharded) model its weights, one parameter at a time."""
    m.init_weights(seed, pretrained)


comm = observe.CommCounter()  # collectives per training step, for bench.py
obs = observe.Observer(out_dir, dist_backend, rank, device, profile, memory_snapshot)
with torch.device("meta"):  # no memory yet: the backend shards first, then materializes
    model = GPT(GPTConfig(**model_args))
model = back.wrap(model, materialize)
pretrained = None  # (every rank held the whole model's weights until its shards were copied out)
gpt = back.unwrap(model)
optimizer = gpt.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), back.optimizer_class)
if init_from == "resume":
    try:
        checkpoint.load(ckpt_path, model, optimizer)
    except checkpoint.CheckpointError as e:
        fail(str(e))
    iter_num, best_val_loss = manifest["iter_num"], manifest["best_val_loss"]
    back.load_loss_scale_state(manifest.get("loss_scale"))
    if master:
        print(f"resumed from {ckpt_path} at iteration {iter_num}")
memory_rows = [obs.memory("after model creation", model, optimizer)]


@torch.no_grad()
def estimate_loss(batches):
    """Mean loss over `batches` fixed batches per split, spread over all ranks (FSDP needs all)."""
    model.eval()
    out = {}
    for split_id, split in enumerate(("train", "val")):
        total = torch.zeros((), dtype=torch.float64, device=device)
        for j in range(math.ceil(batches / world_size)):  # same count on every rank
            k = rank + j * world_size
            X, Y = get_batch(split, 2**40 + split_id, k % batches)  # not an iteration number
            with back.autocast():
                loss = model(X, Y)[1]
            if k < batches:
                total += loss.double()
        if world_size > 1:
            dist.all_reduce(total)
        out[split] = (total / batches).item()
    model.train()
    return out


@torch.no_grad()
def weights_finite(optimizer):
    """Whether every weight is finite, on every rank (each looks at the shards it holds). The
    optimizer's parameters: the shards, also while a unit is gathered (float8's gathered form has no isfinite)."""
    local = [observe.local_tensor(p) for group in optimizer.param_groups for p in group["params"]]
    # (.to: under cpu_offload the shards are in CPU memory, a gathered root's parameters on the GPU)
    finite = torch.stack([torch.isfinite(t).all().to(device) for t in local]).all().to(torch.float32)
    if world_size > 1:
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    return bool(finite.item())


def get_lr(it):
    if not decay_lr:
        return learning_rate
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


peak_flops = observe.peak_flops(torch.cuda.get_device_name(), dtype) if device_type == "cuda" else None

if wandb_log and master:
    import wandb
    try:
        wandb_run = wandb.init(project=wandb_project, name=f"{wandb_run_name}-{dist_backend}-w{world_size}",
                               group=wandb_run_name, config=config)
    except wandb.errors.Error as e:  # no API key, no network: say so, and how to log without them
        fail(f"wandb_log=True: {str(e).splitlines()[0]} (WANDB_MODE=offline logs to ./wandb to sync later)")

# eval_only's rows go beside the training run's, not among them
metrics_path = os.path.join(out_dir, "eval.jsonl" if eval_only else "metrics.jsonl")
metrics_log = None  # (rank 0 logs; the others' checkpoint shards and traces make their own folders)
if master:
    os.makedirs(out_dir, exist_ok=True)
    metrics_log = open(metrics_path, "a" if init_from == "resume" or eval_only else "w")
    if metrics_log.tell():  # a killed run can leave half a line: the first row appended starts a new one
        with open(metrics_path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                metrics_log.write("\n")


def log_metrics(**row):
    metrics_log.write(json.dumps(row) + "\n")
    metrics_log.flush()


def read_when_done(*scalars):
    """Start copying a step's scalars to the host without waiting for the device; returns a function
    that waits for them (only them, not for what was queued after) and returns them as floats, once
    ('skip' reads them before its step and again for the step's row)."""
    host = [t.to("cpu", torch.float32, non_blocking=True) for t in scalars]  # (into pinned memory from a GPU)
    copied = torch.cuda.Event() if device_type == "cuda" else None
    if copied is not None:  # on the stream of the scalars' device, where the copies run
        copied.record(torch.cuda.current_stream(scalars[0].device))

    @functools.cache
    def read():
        if copied is not None:
            copied.synchronize()
        return [t.item() for t in host]
    return read


def finite_step(loss_mean, grad_norm):
    # (with float16's loss scaling an inf norm is routine: the scaler skips that step)
    return math.isfinite(loss_mean) and (math.isfinite(grad_norm) or back.loss_scaling)


def report_last_step():
    """Log the last step's row once its loss and grad norm are on the host. With on_nonfinite='stop'
    that is during the next step (or before an evaluation, a checkpoint, the end): a non-finite one
    exits then, with the checkpoints untouched."""
    global last_step
    if last_step is None:
        return
    (row, read), last_step = last_step, None
    loss_total, grad_norm = read()
    loss_mean = loss_total / world_size
    if on_nonfinite == "stop" and not finite_step(loss_mean, grad_norm):
        fail(f"non-finite loss {loss_mean} or grad norm {grad_norm} at iteration {row['iter']}; "
             f"{checkpoints_kept()} (on_nonfinite='skip' skips such steps)")
    if master:
        log_metrics(**({"iter": row["iter"], "loss": loss_mean, "grad_norm": grad_norm} | row))
        if wandb_log:
            wandb.log({"iter": row["iter"], "train/loss_step": loss_mean, "grad_norm": grad_norm, "lr": row["lr"],
                       "tokens_per_sec": row["tokens_per_sec"]})
        if row["iter"] % log_interval == 0:
            mfu_text = f", mfu {row['mfu'] * 100:.2f}%" if row["mfu"] is not None else ""
            print(f"iter {row['iter']}: loss {loss_mean:.4f}, time {row['dt_ms']:.2f}ms{mfu_text}")


def update_or_skip(loss_sum, grad_norm):
    """Whether this step updates the weights, asked after clipping. 'stop' exits on a bad step
    without saving anything, so it updates without looking: the host queues the step whole, and
    looks (one wait for the device, for both numbers) one step later. 'skip' must look first."""
    global read_step, skipped_in_a_row
    read_step = read_when_done(loss_sum, grad_norm)
    if on_nonfinite == "stop":
        return True
    loss_total, grad_norm = read_step()
    if finite_step(loss_total / world_size, grad_norm):
        skipped_in_a_row = 0
        return True
    skipped_in_a_row += 1
    if skipped_in_a_row > max_skipped_steps:  # a bad batch passes; a diverged model does not
        fail(f"{skipped_in_a_row} steps in a row had a non-finite loss or grad norm (iteration {iter_num}): "
             f"skipping does not recover; {checkpoints_kept()}")
    if master:
        print(f"iter {iter_num}: non-finite loss {loss_total / world_size} or grad norm {grad_norm}: step skipped")
        log_metrics(iter=iter_num, event=metrics.SKIPPED_NONFINITE)
    return False


def report_memory():
    """The step's memory reports, before zero_grad, so that the gradients are counted beside the
    parameters and optimizer state; their time (an all-reduce, a walk over the state) is left out
    of the step's (report_s). The last one holds the training peak, before the final evaluation
    and save."""
    global report_s
    comm.add_step()  # (the memory reports' own all-reduce is not training traffic)
    stages = [stage for stage, due in (("after first step", len(memory_rows) == 1),
                                       ("after last step", iter_num == max_iters - 1)) if due]
    if stages and device_type == "cuda":
        torch.cuda.synchronize()  # (a report waits for the device: what this step queued is in its time)
    report_s = time.time()
    memory_rows.extend(obs.memory(stage, model, optimizer) for stage in stages)
    report_s = time.time() - report_s


# training loop: iterations iter_num .. max_iters-1; evaluate (and checkpoint) every eval_interval
last_step = None  # (row, read): the last step, not yet reported
start_iter = iter_num  # a checkpoint of this iteration exists already (or it is 0)
skipped_in_a_row = 0  # on_nonfinite='skip'
while True:
    lr = get_lr(iter_num)
    for group in optimizer.param_groups:
        group["lr"] = lr
    if iter_num % eval_interval == 0 or iter_num == max_iters or eval_only:
        report_last_step()  # (a non-finite step exits before anything is saved)
        losses = estimate_loss(eval_iters) if eval_iters else None  # eval_iters=0: no evaluation
        if master and losses:
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            log_metrics(iter=iter_num, train_loss=losses["train"], val_loss=losses["val"],
                        **({"evaluated": ckpt_path if init_from == "resume" else init_from} if eval_only else {}))
            if wandb_log:
                wandb.log({"iter": iter_num, "train/loss": losses["train"], "val/loss": losses["val"], "lr": lr})
        improved = losses is not None and losses["val"] < best_val_loss
        if improved:
            best_val_loss = losses["val"]
        # with no evaluation (eval_iters=0) there is no val loss to improve: save at every eval_interval
        if keep_checkpoints and iter_num > start_iter and (improved or always_save_checkpoint or losses is None):
            # a step with a finite loss can still leave weights that are, or that compute, nan or
            # inf (a huge learning rate): such a checkpoint would replace the good ones. Without an
            # evaluation, one batch per split says whether the weights compute finite losses
            checked = losses or estimate_loss(1)
            if not all(map(math.isfinite, checked.values())) or not weights_finite(optimizer):
                fail(f"the model is not finite at iteration {iter_num} (losses {checked}): nothing "
                     f"saved; {checkpoints_kept()}")
            checkpoint.save(out_dir, model, optimizer, keep=keep_checkpoints, meta=dict(
                iter_num=iter_num, best_val_loss=best_val_loss, model_args=model_args, config=config,
                dist_backend=dist_backend, world_size=world_size, loss_scale=back.loss_scale_state(),
                pretrained_from=pretrained_from, job=job))
            if master:
                print(f"saved checkpoint at iteration {iter_num} to {out_dir}")
    if iter_num >= max_iters or eval_only:
        break
    obs.before_step()  # (before the clock: the profiler, when its window opens, starts outside the step)
    t0 = time.time()  # the step's time: not the evaluation and checkpoint above, which are not training

    comm.take()  # drop what evaluation and checkpointing issued
    # one optimizer step over the global batch: this rank's micro-batches, gradients communicated
    # on the last one only, clipping, the update (training.train_step: the step plan.py plans)
    training.train_step(config, back, model, optimizer, local_steps, functools.partial(get_batch, "train"),
                        iter_num, rank, timed=obs.host_time, mark=obs.mark, update=update_or_skip,
                        before_zero_grad=report_memory)
    report_last_step()  # (in this step's time: the wait is for the device, which ran the last one)
    dt = time.time() - t0 - report_s
    obs.after_step()  # (after the clock: the trace, at the window's end, is written outside the step)
    last_step = (dict(iter=iter_num, lr=lr, dt_ms=dt * 1000, tokens_per_sec=tokens_per_iter / dt,
                      mfu=gpt.estimate_mfu(local_steps * batch_size, dt, peak_flops), peak_mem_mb=obs.peak_mb(),
                      host_ms=obs.host_ms), read_step)
    if on_nonfinite != "stop":
        report_last_step()
    iter_num += 1

obs.finish()
memory_rows.append(obs.memory("end", model, optimizer))
if master:
    for row in memory_rows:
        print(f"memory {row['stage']}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items() if k.endswith("_mb")))
        log_metrics(**row)
    if comm.steps:
        log_metrics(event=metrics.COMM_PER_STEP, **comm.per_step())
    metrics_log.close()
leave(0)
