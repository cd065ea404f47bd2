# Fine-tune OpenAI's GPT-2 (124M) on tiny Shakespeare, in GPT-2's BPE (not yet timed on a GPU).
#   python data/shakespeare/prepare.py
#   torchrun --standalone --nproc_per_node=2 train.py config/finetune_shakespeare.py --dist_backend=custom_fsdp
# transformers fetches the weights (offline: HF_HUB_OFFLINE=1, with them in its cache).

out_dir = 'out-shakespeare'
eval_interval = 5
eval_iters = 40
always_save_checkpoint = False  # ~300K training tokens overfit fast: keep only improvements
wandb_project = 'shakespeare'
wandb_run_name = 'ft-gpt2'

init_from = 'gpt2'  # or gpt2-medium, gpt2-large, gpt2-xl (with a sharded backend past one GPU's memory)
dataset = 'shakespeare'
block_size = 1024
batch_size = 1
gradient_accumulation_steps = 32  # 32K tokens per step; divides 1, 2, 4, 8, 16 or 32 processes
max_iters = 20
learning_rate = 3e-5  # small and constant: adjust the pretrained weights, do not retrain them
decay_lr = False
