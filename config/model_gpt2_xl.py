# GPT-2 XL shape. Use after a training config:
#   python train.py config/train_gpt2.py config/model_gpt2_xl.py
# params ~= 12*L*d^2 + vocab*d + block*d = 1474.6M + 80.5M + 1.6M ~= 1.56B (vocab 50304, block 1024)
n_layer = 48
n_head = 25
n_embd = 1600
