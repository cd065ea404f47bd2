# GPT-2 medium shape. Use after a training config:
#   python train.py config/train_gpt2.py config/model_gpt2_medium.py
# params ~= 12*L*d^2 + vocab*d + block*d = 302.0M + 51.5M + 1.0M ~= 354.5M (vocab 50304, block 1024)
n_layer = 24
n_head = 16
n_embd = 1024
