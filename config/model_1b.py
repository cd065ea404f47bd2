# A ~1B-parameter shape: wider and shallower than GPT-2 XL, head dim 128 (2048 / 16),
# which keeps attention matmuls efficient. Use after a training config:
#   python train.py config/train_gpt2.py config/model_1b.py
# params ~= 12*L*d^2 + vocab*d + block*d
#        = 12*24*2048^2 + 50304*2048 + 1024*2048
#        = 1,207,959,552 + 103,022,592 + 2,097,152 = 1,313,079,296  (~1.3B; ~1.21B excluding embeddings)
n_layer = 24
n_head = 16
n_embd = 2048
