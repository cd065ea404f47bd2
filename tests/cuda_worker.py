"""
One process on one GPU (NCCL, world size 1): fsdp_impl against PyTorch's FSDP2 with and without
CPU offload, which the CPU machines cannot run. tests/test_cuda.py asserts on what it prints.

    python tests/cuda_worker.py OUT.json

Each mode trains a small GPT under both implementations from the same init on the same batches
(AdamW, fused as train.py's) and records losses, gradient norms and final parameters. Attention
runs its math kernels and cuBLAS its deterministic ones, so that equal inputs give equal bits.
"""
import json
import os
import sys
import traceback
from pathlib import Path

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import CPUOffloadPolicy  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2MixedPrecision  # noqa: E402
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fsdp_impl import MixedPrecisionPolicy as OurMixedPrecision  # noqa: E402
from fsdp_impl import CPUOffloadPolicy as OurOffload  # noqa: E402
from fsdp_impl import fully_shard as our_fully_shard  # noqa: E402
from backends import use_deterministic_kernels  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

CFG = dict(block_size=32, vocab_size=96, n_layer=3, n_head=2, n_embd=64)
BATCH, STEPS = 4, 3
IMPLS = {"fsdp2": (fsdp2_fully_shard, FSDP2MixedPrecision, CPUOffloadPolicy),
         "ours": (our_fully_shard, OurMixedPrecision, OurOffload)}
MODES = {  # name -> what differs from offload in fp32, one micro-step, ZeRO-3, every unit called once
    "plain": dict(offload=False),
    "offload": dict(),
    "offload_bf16": dict(bf16=True),
    "offload_zero2": dict(reshard=False),
    "offload_accumulate_synced": dict(micro=2),  # the second micro-step adds to CPU grads
    "offload_accumulate_no_sync": dict(micro=2, synced=False),
    # block 1 runs twice per forward: its second reduction adds to grads its first copies out
    "offload_unit_called_twice": dict(twice=True),
    "offload_hsdp": dict(hsdp=True),  # a (replicate, shard) mesh of 1 x 1: the all-reduce path
    # built in CPU memory with a buffer the first block's forward uses, fed CPU tensors: fully_shard
    # moves the buffer to the GPU, the root's forward the inputs (FSDP2 does both)
    "cpu_built": dict(offload=False, cpu_built=True),
}
DEFAULTS = dict(offload=True, bf16=False, micro=1, synced=True, reshard=True, twice=False, hsdp=False,
                cpu_built=False)


def build(impl, mesh, offload, bf16, reshard, twice, cpu_built):
    shard, mp_cls, offload_cls = IMPLS[impl]
    kw = dict(mesh=mesh, reshard_after_forward=reshard)
    if bf16:
        kw["mp_policy"] = mp_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:
        kw["offload_policy"] = offload_cls()
    with torch.device("cpu" if cpu_built else "meta"):
        model = GPT(GPTConfig(**CFG))
    if cpu_built:
        model.init_weights(0)
        first = model.transformer.h[0]
        first.register_buffer("shift", torch.full((CFG["n_embd"],), 0.5))
        first.register_forward_pre_hook(lambda module, args: (args[0] + module.shift,))
    for block in model.transformer.h:
        shard(block, **kw)
    shard(model, **{**kw, "reshard_after_forward": None})  # the root keeps its parameters, as in backends.py
    if not cpu_built:
        model.to_empty(device="cpu" if offload else "cuda")  # (FSDP2 asks offloaded shards to start in CPU memory)
        model.init_weights(0)
    if twice:
        model.transformer.h.insert(2, model.transformer.h[1])  # forward runs h.0, h.1, h.1, h.2
    return model


def batches(step, micro):
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randint(0, CFG["vocab_size"], (BATCH, CFG["block_size"]), generator=g)
    y = torch.randint(0, CFG["vocab_size"], (BATCH, CFG["block_size"]), generator=g)
    return x.cuda(), y.cuda()


def train(impl, meshes, mode):
    m = {**DEFAULTS, **MODES[mode]}
    micro, synced = m["micro"], m["synced"]
    model = build(impl, meshes["hsdp" if m["hsdp"] else "fsdp"], m["offload"], m["bf16"], m["reshard"], m["twice"],
                  m["cpu_built"])
    fed = "cpu" if m["cpu_built"] else "cuda"
    initial = {n: p.to_local().detach().cpu().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    losses, norms = [], []
    for step in range(STEPS):
        for k in range(micro):
            model.set_requires_gradient_sync(synced or k == micro - 1)
            _, loss = model(*(t.to(fed) for t in batches(step, k)))
            (loss / micro).backward()
            losses.append(loss.item())
        grads = [p.grad.to_local() for p in model.parameters()]
        norms.append(torch.nn.utils.get_total_norm(grads).item())
        opt.step()
        opt.zero_grad()
    params = {n: p.to_local().detach().cpu() for n, p in model.named_parameters()}  # one rank: the whole tensor
    _, loss = model(*batches(STEPS, 0))
    loss.backward()
    where = {"param": sorted({p.to_local().device.type for p in model.parameters()}),
             "grad_after_backward": sorted({p.grad.to_local().device.type for p in model.parameters()}),
             "moved": all(not torch.equal(initial[n], params[n]) for n in params)}
    opt.zero_grad()
    return model, losses, norms, params, where


def copy_streams(model):
    """Profile one step: the streams of host-to-device and device-to-host copies and of kernels."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, loss = model(*batches(STEPS + 1, 0))
        loss.backward()
        torch.cuda.synchronize()
    path = Path(os.environ.get("TMPDIR", "/tmp")) / "cuda_worker_trace.json"
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    busy = {}
    for e in events:
        if e.get("cat") == "kernel":
            busy[e["args"]["stream"]] = busy.get(e["args"]["stream"], 0) + e["dur"]
    compute = max(busy, key=busy.get)
    out = {"h2d_bytes_off_compute": 0, "h2d_bytes_on_compute": 0, "d2h_bytes_off_compute": 0,
           "d2h_bytes_on_compute": 0}
    for e in events:
        if e.get("cat") != "gpu_memcpy":
            continue
        kind = "h2d" if "HtoD" in e["name"] else "d2h" if "DtoH" in e["name"] else None
        if kind:
            where = "on" if e["args"]["stream"] == compute else "off"
            out[f"{kind}_bytes_{where}_compute"] += e["args"].get("bytes", 0)
    return out


def main():
    use_deterministic_kernels()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    torch.cuda.set_device(0)
    meshes = {"fsdp": init_device_mesh("cuda", (1,)),
              "hsdp": init_device_mesh("cuda", (1, 1), mesh_dim_names=("replicate", "shard"))}  # (FSDP2 wants names)
    results = {}
    for mode in MODES:
        try:
            record = {}
            runs = {}
            for impl in IMPLS:
                model, losses, norms, params, where = train(impl, meshes, mode)
                runs[impl] = (losses, norms, params)
                record[impl] = {"losses": losses, "norms": norms, "where": where}
                if mode in ("plain", "offload_bf16"):
                    record[impl]["copies"] = copy_streams(model)
                del model
            (l2, n2, p2), (l1, n1, p1) = runs["fsdp2"], runs["ours"]
            record["bitwise"] = l1 == l2 and n1 == n2 and all(torch.equal(p1[k], p2[k]) for k in p2)
            record["param_max_diff"] = max((p1[k].double() - p2[k].double()).abs().max().item() for k in p2)
            results[mode] = record
        except Exception:
            results[mode] = {"error": traceback.format_exc()}
    dist.destroy_process_group()
    Path(sys.argv[1]).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
