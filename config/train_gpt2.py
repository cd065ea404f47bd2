# GPT-2 124M on OpenWebText.
#   python data/openwebtext/prepare.py
#   torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py

wandb_log = False
wandb_project = 'owt'
wandb_run_name = 'gpt2-124M'

# tokens per optimizer step: 12 batch * 1024 block * 40 accum = 491,520 (~0.5M, as in GPT-2/3)
# gradient_accumulation_steps is the global count across all ranks (8 GPUs -> 5 micro-steps each)
batch_size = 12
block_size = 1024
gradient_accumulation_steps = 5 * 8

# 600k steps * 0.5M tokens = ~300B tokens
max_iters = 600000
lr_decay_iters = 600000

# evaluation: the dataset is huge, so evaluate rarely but with many batches
eval_interval = 1000
eval_iters = 200
log_interval = 10

weight_decay = 1e-1
