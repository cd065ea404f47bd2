# A 7B shape, the size users most often ask about: LLaMA-7B's depth and width (32 layers, 32 heads
# of 128, 4096 wide) with GPT-2's blocks, over 2048 tokens of context (so a step of train_gpt2.py's
# batch takes 1M tokens). Use after a training config:
#   python plan.py config/train_gpt2.py config/model_7b.py --nproc=8,64,1024
# params ~= 12*L*d^2 + vocab*d + block*d
#        = 12*32*4096^2 + 50304*4096 + 2048*4096
#        = 6,442,450,944 + 206,045,184 + 8,388,608 = 6,656,884,736  (~6.7B)
n_layer = 32
n_head = 32
n_embd = 4096
block_size = 2048
