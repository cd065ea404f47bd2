# GPT-2 large shape. Use after a training config:
#   python train.py config/train_gpt2.py config/model_gpt2_large.py
# params ~= 12*L*d^2 + vocab*d + block*d = 707.8M + 64.4M + 1.3M ~= 773.5M (vocab 50304, block 1024)
n_layer = 36
n_head = 20
n_embd = 1280
