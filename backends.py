"""
The one place where the distributed backends differ. train.py talks to a Backend only:

    rank, world_size, device = init_distributed(...)  # join torchrun's process group
    backend = make_backend(name, cfg)                 # 'ddp' | 'fsdp' | 'custom_fsdp'
    model = backend.wrap(model, materialize)          # float8, compile, shard, materialize weights on device
    with backend.autocast(): loss = model(x, y)       # mixed precision where the backend needs autocast
    backend.set_grad_sync(model, is_last_micro_step)  # no_sync-style accumulation
    backend.backward(loss)
    norm = backend.clip_grad_norm(optimizer, max_norm)  # total norm before clipping (0-dim tensor)
    backend.step(optimizer)                           # or skip_step(optimizer): a non-finite step skipped
    backend.loss_scaling, loss_scale_state(), load_loss_scale_state(state)  # float16's scaler (DDP), checkpointed
    gpt = backend.unwrap(model)                       # the GPT inside: its optimizer groups, MFU

`fsdp` is PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard); `custom_fsdp` is ours
(fsdp_impl), with the same API, so the two share one class and differ only in the import.
"""
import logging
import os
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as adam_on_tensors  # (the function Adam.step calls)

BACKENDS = ("ddp", "fsdp", "custom_fsdp")
# FSDP2 prefetches in backward unless given a list: with none, the unit that runs backward next
FSDP_PREFETCH_OFF = "fsdp: prefetch=False switches forward prefetch off; FSDP2 keeps its backward prefetch (no public switch)"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WRAP_POLICIES = ("block", "model", "size")


def init_distributed(dist_backend, pg_backend, device, timeout_s):
    """Join the process group torchrun describes (or make a group of one for FSDP without torchrun).

    Returns (rank, world_size, device): one GPU per process on CUDA; gloo on CPU.
    """
    if "RANK" not in os.environ:
        if device.startswith("cuda"):  # (--device=cuda:1: the current device, which fsdp_impl computes on)
            torch.cuda.set_device(device)
        if dist_backend != "ddp":  # FSDP needs a process group, even a group of one
            dist.init_process_group("gloo" if device == "cpu" else pg_backend, store=dist.HashStore(),
                                    rank=0, world_size=1, pg_options=high_priority_streams(pg_backend, device))
        return 0, 1, device
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    timeout, store, restart = timedelta(seconds=timeout_s), None, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart != "0" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's store still holds the failed attempt's keys (peers' old addresses): use a fresh namespace
        agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                    is_master=False, timeout=timeout)
        store = dist.PrefixStore(f"attempt{restart}", agent_store)
    dist.init_process_group(pg_backend if device.startswith("cuda") else "gloo", timeout=timeout, store=store,
                            rank=rank if store else -1, world_size=world_size if store else -1,
                            pg_options=high_priority_streams(pg_backend, device))
    if world_size > 1:
        # every rank is through the connecting before any may refuse the settings and leave: a peer still
        # connecting would lose torchrun's store and print a traceback under the refusal's one line
        dist.barrier(device_ids=[local_rank] if device.startswith("cuda") else None)
    return rank, world_size, device


def high_priority_streams(pg_backend, device):
    """NCCL's options with its internal streams at high priority, where FSDP2 puts its all-gather and
    reduce-scatter streams: the collective kernels that fsdp_impl and DDP issue run on those streams,
    and the GPU schedules them before compute kernels queued at the same time. Every backend gets it."""
    if pg_backend != "nccl" or not device.startswith("cuda") or not dist.is_nccl_available():
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return options


def use_deterministic_kernels():
    """Equal inputs give equal bits on a GPU, so that backends can be compared bit for bit: cuBLAS's
    fixed workspace (read when cuBLAS starts: call this before the first matmul), torch's
    deterministic algorithms, and math attention (the fused kernels' backward sums in no fixed order)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    for kernel in ("flash", "mem_efficient", "cudnn"):
        getattr(torch.backends.cuda, f"enable_{kernel}_sdp")(False)


class BackendError(ValueError):
    """Bad settings: train.py prints the message as one line and exits non-zero."""


def _cpp_compiler_found():
    """Whether torch.compile finds the C++ compiler it builds CPU kernels with (g++, or $CXX). Without
    one it fails only at the first step, in a long traceback."""
    from torch._inductor import cpp_builder, exc
    try:
        cpp_builder.get_cpp_compiler()
        return True
    except (exc.InvalidCxxCompiler, OSError):
        return False


def compile_per_block(model):
    """Compile each block's forward, and the output layer with the loss, as graphs of their own, so
    that the sharded backends' hooks run between the graphs, never inside one."""
    for b in model.transformer.h:
        b.forward = torch.compile(b.forward)
    model.logits_and_loss = torch.compile(model.logits_and_loss)


def torchao_float8(*names):
    """Names from torchao.float8, imported quietly: torchao logs each optional CUDA kernel library it
    cannot load (none is needed here), and torch warns of one of its enum registrations."""
    quiet = {name: logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")}
    levels = {name: logger.level for name, logger in quiet.items()}
    for logger in quiet.values():
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8
    finally:
        for name, logger in quiet.items():
            logger.setLevel(levels[name])
    return [getattr(torchao.float8, name) for name in names]


def float8_training(model, gather_in_float8):
    """torchao's float8 training: every Linear but the output head (tied to the embedding, and the
    most sensitive to rounding: torchtitan leaves it out too) computes its three matmuls in float8,
    with dynamic per-tensor scales. gather_in_float8: the weights become subclasses whose FSDP
    all-gather extension sends one byte an element and their scale; DDP keeps plain weights."""
    Float8LinearConfig, convert_to_float8_training = torchao_float8("Float8LinearConfig", "convert_to_float8_training")
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=gather_in_float8),
                               module_filter_fn=lambda module, fqn: fqn != "lm_head")


def grad_norm(grads):
    """The 2-norm of all `grads` together. On the CPU, row by row and then over the rows: torch's norm
    of a whole CPU tensor runs on one thread and sums it in one long float32 run, which is slow and
    loses precision for offloaded grads of a large model. On the GPU torch's multi-tensor norm,
    one kernel for them all. (A backend's grads are all on one device.)"""
    if not grads or grads[0].device.type != "cpu":
        return torch.nn.utils.get_total_norm(grads)
    rows = [g.reshape(g.shape[0], -1) if g.dim() > 1 and g.numel() else g.reshape(1, -1) for g in grads]
    return torch.linalg.vector_norm(torch.cat([torch.linalg.vector_norm(r, dim=1) for r in rows]))


def make_backend(name, cfg):
    if name not in BACKENDS:
        raise BackendError(f"unknown dist_backend '{name}' (choose one of {', '.join(BACKENDS)})")
    if cfg["dtype"] not in DTYPES:
        raise BackendError(f"unknown dtype '{cfg['dtype']}' (choose one of {', '.join(DTYPES)})")
    if cfg["wrap_policy"] not in WRAP_POLICIES:  # (checked under ddp too: the same flags go to every backend)
        raise BackendError(f"unknown wrap_policy '{cfg['wrap_policy']}' (choose one of {', '.join(WRAP_POLICIES)})")
    return DDPBackend(cfg) if name == "ddp" else FSDPBackend(name, cfg)


class Backend:
    loss_scaling = False  # float16 under DDP: overflowing steps are expected and skipped by the scaler
    optimizer_class = torch.optim.AdamW  # what model.configure_optimizers builds
    note = None  # a line train.py prints at start: what a setting does differently under this backend

    def __init__(self, cfg):
        self.cfg = cfg
        self.device = torch.device(cfg["device"])
        self.dtype = DTYPES[cfg["dtype"]]
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        if cfg["cpu_offload"] and self.device.type != "cuda":
            raise BackendError("cpu_offload needs a CUDA device: on CPU the parameters already live in CPU memory")
        if cfg["float8"]:
            try:
                torchao_float8()
            except ImportError:
                raise BackendError("float8=True needs torchao: pip install -r requirements.txt") from None
        if cfg["compile"] and self.device.type == "cpu" and not _cpp_compiler_found():
            raise BackendError("compile=True on CPU needs a C++ compiler (torch.compile builds its CPU kernels with "
                               "g++, or the one $CXX names): install one, or set --compile=False")

    def autocast(self):
        return nullcontext()

    def set_grad_sync(self, model, enabled):
        pass

    def backward(self, loss):
        loss.backward()

    @torch.no_grad()
    def clip_grad_norm(self, optimizer, max_norm):
        """Total norm of the gradients of the parameters `optimizer` steps, before clipping: a 0-dim
        tensor on the device (reading it waits for the device: train.py reads it once, with the
        loss); clips in place when max_norm > 0."""
        grads = self.local_grads(optimizer)
        norm = self.total_norm(grads)
        if max_norm > 0 and grads:  # clip_grads_with_norm_'s scaling (it takes parameters, not gradients)
            torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(grads[0].device))
        return norm

    def local_grads(self, optimizer):
        """The gradients this rank holds, in the optimizer's order. (model.parameters() would walk every
        module at every step, which costs host time on a host-bound GPU step.)"""
        return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]

    def total_norm(self, grads):
        return grad_norm(grads)

    def step(self, optimizer):
        optimizer.step()

    def skip_step(self, optimizer):
        """A step not taken (non-finite loss, on_nonfinite='skip')."""

    def loss_scale_state(self):
        """What a checkpoint keeps of the loss scaling (float16 under DDP), as JSON."""
        return {}

    def load_loss_scale_state(self, state):
        pass

    @staticmethod
    def unwrap(model):
        """The GPT itself (its optimizer groups, estimate_mfu); checkpoints take the wrapped model."""
        return getattr(model, "module", model)


class DDPBackend(Backend):
    """DistributedDataParallel (or the plain model when there is one process)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        if cfg["cpu_offload"] or cfg["replicate_degree"] != 1:
            raise BackendError("cpu_offload and replicate_degree apply to the sharded backends only")
        # float16 needs loss scaling to keep small gradients from underflowing
        self.loss_scaling = self.dtype == torch.float16
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.loss_scaling)

    def autocast(self):
        if self.dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def wrap(self, model, materialize):
        if self.cfg["float8"]:
            float8_training(model, gather_in_float8=False)
        # to_empty() turns each registration of a tied meta parameter into its own tensor: re-tie
        registrations = {}
        for m in model.modules():
            for name, p in m._parameters.items():
                registrations.setdefault(p, []).append((m, name))
        model.to_empty(device=self.device)
        for (first, first_name), *others in registrations.values():
            for m, name in others:
                m._parameters[name] = first._parameters[first_name]
        materialize(model)
        if self.cfg["compile"]:
            model.compile()
        if self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP
            model = DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        return model

    def set_grad_sync(self, model, enabled):
        if self.world_size > 1:
            model.require_backward_grad_sync = enabled  # what DDP's no_sync() toggles

    def backward(self, loss):
        self.scaler.scale(loss).backward()  # the scaler is a no-op unless dtype is float16

    def clip_grad_norm(self, optimizer, max_norm):
        self.scaler.unscale_(optimizer)
        return super().clip_grad_norm(optimizer, max_norm)

    def step(self, optimizer):
        self.scaler.step(optimizer)
        self.scaler.update()

    def skip_step(self, optimizer):
        self.scaler.update()  # clip_grad_norm unscaled: the scaler must close the step (and back off)

    def loss_scale_state(self):
        return self.scaler.state_dict()  # {} unless float16; else the scale and its growth counter

    def load_loss_scale_state(self, state):
        if state and self.loss_scaling:  # (a checkpoint of another dtype has none: start afresh)
            self.scaler.load_state_dict(state)


class AdamWOnLocalShards(torch.optim.AdamW):
    """AdamW whose step runs on the local tensors of DTensor parameters and state: the fused kernel
    AdamW's step runs, on the same tensors, without DTensor's dispatch of it. That dispatch costs
    several times the plain model's optimizer step in host time, which a small model's GPU step
    waits for. A subclass, not a call of its own, so that optimizer.step() keeps its hooks
    (fsdp_impl reshards before a step through one); the state, its creation and the state_dict are
    AdamW's. It refuses a closure and differentiable=True, which train.py does not use."""

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None or any(group["differentiable"] for group in self.param_groups):
            raise ValueError("AdamWOnLocalShards.step takes no closure and no differentiable=True "
                             "(torch's AdamW does)")
        for group in self.param_groups:
            # params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step counters, of those with a grad
            tensors = [[] for _ in range(6)]
            has_complex = self._init_group(group, *tensors)  # (creates the state at the first step)
            beta1, beta2 = group["betas"]
            adam_on_tensors(  # the arguments Adam.step passes
                *([t._local_tensor if isinstance(t, DTensor) else t for t in ts] for ts in tensors),
                amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
                fused=group["fused"], grad_scale=getattr(self, "grad_scale", None),
                found_inf=getattr(self, "found_inf", None), decoupled_weight_decay=group["decoupled_weight_decay"])


class FSDPBackend(Backend):
    """FSDP2 ('fsdp') or ours ('custom_fsdp'): the same calls, two implementations."""
    optimizer_class = AdamWOnLocalShards

    def __init__(self, name, cfg):
        super().__init__(cfg)
        self.name = name
        if name == "fsdp" and not cfg["prefetch"]:
            self.note = FSDP_PREFETCH_OFF
        if self.dtype == torch.float16:
            raise BackendError("dtype=float16 needs loss scaling, which the sharded backends do not do: use bfloat16")
        replicas = cfg["replicate_degree"]
        if replicas < 1:
            raise BackendError(f"replicate_degree={replicas} must be at least 1 (1: no replication)")
        if self.world_size % replicas:
            raise BackendError(f"replicate_degree={replicas} does not divide the world size {self.world_size}")
        if name == "fsdp":
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
            self.offload_policy = CPUOffloadPolicy() if cfg["cpu_offload"] else None
        else:
            from fsdp_impl import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
            self.offload_policy = CPUOffloadPolicy() if cfg["cpu_offload"] else None
        self.fully_shard = fully_shard
        self.mp_policy = MixedPrecisionPolicy(
            param_dtype=None if self.dtype == torch.float32 else self.dtype, reduce_dtype=torch.float32)
        from torch.distributed.device_mesh import init_device_mesh
        shape = (replicas, self.world_size // replicas) if replicas > 1 else (self.world_size,)
        names = ("replicate", "shard") if replicas > 1 else ("shard",)
        self.mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
        self.shard_group = self.mesh.get_group(self.mesh.ndim - 1)

    def unit_groups(self, blocks):
        """Consecutive blocks per unit: one each, all together, or grouped up to min_wrap_params."""
        policy = self.cfg["wrap_policy"]
        if policy == "block":
            return [[b] for b in blocks]
        if policy == "model":
            return []
        groups, current, size = [], [], 0
        for b in blocks:
            current.append(b)
            size += sum(p.numel() for p in b.parameters())
            if size >= self.cfg["min_wrap_params"]:
                groups.append(current)
                current, size = [], 0
        return groups + ([current] if current else [])

    def wrap(self, model, materialize):
        if self.cfg["float8"]:  # (before fully_shard: the float8 weights are what it shards)
            float8_training(model, gather_in_float8=True)
        self.model = model
        blocks = list(model.transformer.h)
        groups = self.unit_groups(blocks)
        if self.cfg["compile"]:
            # the FSDP hooks stay outside the graphs: with units per block, compile each block's
            # forward and the output layer with the loss; with one unit, the whole forward is
            # one graph (its hooks run before and after it)
            if groups:
                compile_per_block(model)
            else:
                model.forward = torch.compile(model.forward)
        kwargs = dict(mesh=self.mesh, reshard_after_forward=self.cfg["reshard_after_forward"],
                      mp_policy=self.mp_policy)
        if self.offload_policy is not None:
            kwargs["offload_policy"] = self.offload_policy
        for i, group in enumerate(groups):
            # the last unit's backward runs right after forward: resharding it would only
            # gather it again at once, so it stays unsharded (both implementations alike)
            reshard = kwargs["reshard_after_forward"] and i < len(groups) - 1
            self.fully_shard(group if len(group) > 1 else group[0], **{**kwargs, "reshard_after_forward": reshard})
        # the root keeps wte/lm_head (tied) together; None: like FSDP2's default it does not
        # reshard after forward, since backward needs it again at once
        self.fully_shard(model, **{**kwargs, "reshard_after_forward": None})
        # offloaded shards live in CPU memory from the start (FSDP2 asks for that)
        model.to_empty(device="cpu" if self.cfg["cpu_offload"] else self.device)
        materialize(model)
        # explicit prefetch lists, so both implementations prefetch the same units: in forward
        # the next unit, in backward the one that runs backward next. prefetch=False empties them:
        # no forward prefetch; in backward an empty list is FSDP2's default, the next unit, and
        # only fsdp_impl has a switch for it
        heads, on = [g[0] for g in groups], self.cfg["prefetch"]  # (a unit's first block stands for it)
        orders = {"set_modules_to_forward_prefetch": [model] + heads,
                  "set_modules_to_backward_prefetch": [model] + heads[::-1]}
        for setter, order in orders.items():
            for module, nxt in zip(order, order[1:] + [None]):
                getattr(module, setter)([nxt] if on and nxt is not None else [])
        if not on and self.name == "custom_fsdp":
            model.set_backward_prefetch(False)
        return model

    def step(self, optimizer):
        optimizer.step()
        if self.cfg["float8"]:
            # the next gathers' float8 scales from the updated weights, in one all-reduce for them all
            # (without it, each weight's pre-all-gather hook reduces its own amax)
            precompute, = torchao_float8("precompute_float8_dynamic_scale_for_fsdp")
            precompute(self.model)

    def set_grad_sync(self, model, enabled):
        model.set_requires_gradient_sync(enabled)
        if not self.cfg["reshard_after_backward"]:  # gathered until the micro-step that syncs, which frees them
            model.set_reshard_after_backward(enabled)

    def local_grads(self, optimizer):
        """The local shards of the gradients: through DTensor each foreach op of the norm and the
        clipping would be a Python dispatch per gradient, on the host's time at every step."""
        return [g._local_tensor for g in super().local_grads(optimizer)]

    def total_norm(self, grads):
        """Each rank's squared norm summed over the shard group (x^2, sum, x^(1/2), as DTensor
        reduces a partial norm); the replicas of HSDP hold the same shards and are left out."""
        # (.to: offloaded gradients live in CPU memory, NCCL's collective wants the device)
        norm = grad_norm(grads).to(self.device)
        if self.shard_group.size() > 1:
            norm = norm ** 2
            dist.all_reduce(norm, group=self.shard_group)
            norm = norm ** (1.0 / 2)
        return norm
