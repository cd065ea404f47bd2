# Small character-level model on tiny Shakespeare, sized for a CPU: README's quick start trains it on 2 processes.
#   python data/shakespeare_char/prepare.py
#   python train.py config/train_shakespeare_char.py

# where results go and how often we look at them
out_dir = 'out-shakespeare-char'
eval_interval = 250   # val loss is the only honest signal on a tiny dataset, check it often
eval_iters = 20       # few batches per estimate: noisy but cheap on CPU
log_interval = 10
always_save_checkpoint = False  # small data overfits; keep only checkpoints that improve val loss

wandb_log = False
wandb_project = 'shakespeare-char'
wandb_run_name = 'mini-gpt'

# data: ~1M characters, so short contexts and small batches are plenty
dataset = 'shakespeare_char'
gradient_accumulation_steps = 4  # global micro-batches per step: divides 1, 2 or 4 processes
batch_size = 12
block_size = 64       # characters of context

# model: ~0.8M params, small enough for a CPU
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0

# optimizer / schedule: a tiny model tolerates a high learning rate
learning_rate = 1e-3
max_iters = 2000
lr_decay_iters = 2000  # decay over the whole run
min_lr = 1e-4          # ~learning_rate / 10
beta2 = 0.99           # more tokens-per-step noise than GPT-2 scale, so a shorter second-moment memory
warmup_iters = 100
