# The baby GPT on characters, sized for one GPU: python train.py configs/shakespeare_char.py
out_dir = "out-shakespeare-char"
dataset = "shakespeare_char"
eval_interval = 250
eval_iters = 200
log_interval = 10
always_save_checkpoint = False  # it overfits: save only when val improves (and at the end; best.pt keeps the best)

n_layer = 6
n_head = 6
n_embd = 384
block_size = 256  # characters of context
dropout = 0.2

batch_size = 64
global_batch_size = 64

learning_rate = 1e-3  # a small model can take a high rate
max_iters = 5000
lr_decay_iters = 5000
min_lr = 1e-4
beta2 = 0.99  # few tokens per step
warmup_iters = 100
