# Evaluate OpenAI's GPT-2 (124M) on OpenWebText: the loss the GPT-2 configs start from and aim at.
#   python data/openwebtext/prepare.py
#   torchrun --standalone --nproc_per_node=8 train.py config/eval_gpt2.py    (--init_from=gpt2-xl, ...)

out_dir = 'out-eval-gpt2'
init_from = 'gpt2'
eval_only = True
dataset = 'openwebtext'
batch_size = 8
block_size = 1024
eval_iters = 500  # 4M tokens per split, spread over the processes
