# GPT-2 small (124M) from scratch on 10B tokens of FineWeb-Edu, in the style of the llm.c and
# nanoGPT reproductions. First: python data/fineweb/prepare.py (about 20 GB of shards). Then:
#   torchrun --standalone --nproc_per_node=8 train.py configs/gpt_small.py
# Cost: 6 x 124M x 10B = 7.5e18 FLOPs plus attention; one H100 runs 0.47M tokens/s here, as
# fast as llm.c (docs/performance.md), so ~6 hours on one H100 and under an hour on eight.
# Expect a val loss of about 3.3 on FineWeb (llm.c's GPT-2 124M run reached 3.28 at 10B tokens)
# and lower on FineWeb-Edu, whose text is easier to predict. A quick run on a small corpus:
# --dataset=shakespeare.
out_dir = "out-gpt-small"
dataset = "fineweb"
eval_interval = 250
eval_iters = 10                 # 10 x 512 windows = 5.2M tokens per split and eval

n_layer = 12
n_head = 12
n_embd = 768
block_size = 1024
dropout = 0.0
bias = True
pad_vocab_to = 64               # 50257 -> 50304 embedding rows: faster matmuls, same model

# 512 sequences x 1024 tokens = 524,288 tokens (~0.5M) per optimizer step; 512 divides by
# 32 x {1, 2, 4, 8, 16} processes, so accumulation adapts to the world size. 32 sequences of
# 1024 tokens need about 25 GB per GPU with compile: use --batch_size=16 or 8 on smaller cards.
batch_size = 32
global_batch_size = 512

learning_rate = 6e-4
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
max_iters = 19073               # 10B tokens / 524,288 per step
warmup_iters = 700
lr_decay_iters = 19073
min_lr = 6e-5                   # cosine down to 10%

dtype = "bfloat16"
compile = True
