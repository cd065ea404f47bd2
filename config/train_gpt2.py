# GPT-2 124M (12 layers, 12 heads, 768 wide, 1024 tokens of context) trained from scratch on
# OpenWebText, GPT-2's BPE vocabulary padded to 50304. Prepare the data once (internet, ~17GB):
#   python data/openwebtext/prepare.py
#   torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py --dist_backend=custom_fsdp
# Larger shapes: add config/model_*.py after this file (same data, batch and schedule).

out_dir = 'out-openwebtext'
wandb_log = False
wandb_project = 'owt'
wandb_run_name = 'gpt2-124M'

# data
dataset = 'openwebtext'
# tokens per optimizer step: 16 batch * 1024 block * 32 accum = 524,288 (0.5M, as GPT-3 small)
# gradient_accumulation_steps is the global count split across ranks, so 32 runs unchanged on
# 8, 16 or 32 GPUs (4, 2 or 1 micro-steps each). Short of memory: halve batch_size and double this.
batch_size = 16
block_size = 1024
gradient_accumulation_steps = 32

# model: GPT-2 small's shape, no biases; no dropout, as one pass over this much text hardly overfits
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False

# AdamW with GPT-3 small's settings: peak 6e-4, decayed by cosine to a tenth over the whole run
learning_rate = 6e-4
min_lr = 6e-5
warmup_iters = 2000
max_iters = 600000  # 600k steps * 0.5M tokens = ~315B tokens
lr_decay_iters = 600000
beta2 = 0.95  # large batches: a shorter second-moment memory keeps steps stable
weight_decay = 1e-1

# evaluation: the dataset is huge, so evaluate rarely but with many batches
eval_interval = 1000
eval_iters = 200
log_interval = 10
