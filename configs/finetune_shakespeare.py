# Fine-tune OpenAI's GPT-2 (124M) on Shakespeare in GPT-2 BPE tokens:
#   python train.py configs/finetune_shakespeare.py
# The weights come from the Hugging Face cache (downloaded once when a network exists) or from a
# local folder: --init_from=PATH. Larger models: --init_from=gpt2-medium, gpt2-large, gpt2-xl.
# A few steps at a small learning rate are enough; val loss starts at GPT-2's own (measure it on this
# set, see configs/eval_gpt2.py) and falls within the first steps; run longer and it overfits.
out_dir = "out-shakespeare"
dataset = "shakespeare"
init_from = "gpt2"
eval_interval = 5
eval_iters = 10
log_interval = 1
always_save_checkpoint = False  # save only when val improves (and at the end; best.pt keeps the best)

block_size = 1024              # GPT-2's context; a smaller one crops the position table
dropout = 0.0
bias = True                    # GPT-2 has biases

batch_size = 1                 # 1 x 1024 tokens per micro-step fits a small GPU and a CPU
global_batch_size = 32         # 32,768 tokens per optimizer step

learning_rate = 3e-5           # constant: fine-tuning, not training
decay_lr = False
warmup_iters = 0
max_iters = 20
weight_decay = 0.0
beta2 = 0.99
