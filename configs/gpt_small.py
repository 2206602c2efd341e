# GPT-2 124M on 8 GPUs: torchrun --standalone --nproc_per_node=8 train.py configs/gpt_small.py
out_dir = "out-gpt-small"
dataset = "shakespeare"  # GPT-2 BPE; for now, until a larger corpus lands (it will overfit)
eval_interval = 250
eval_iters = 20

n_layer = 12
n_head = 12
n_embd = 768
block_size = 1024
dropout = 0.0
bias = True

# 480 sequences x 1024 tokens = 491,520 tokens (~0.5M) per optimizer step;
# 480 divides by 12 x {1, 2, 4, 5, 8} processes, so accumulation adapts to the world size.
batch_size = 12
global_batch_size = 480

learning_rate = 6e-4
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
max_iters = 5000
warmup_iters = 200
lr_decay_iters = 5000
min_lr = 6e-5

dtype = "bfloat16"
compile = True
