# Val loss of OpenAI's gpt2 on a GPT-2 BPE dataset, without training (max_iters = 0):
#   python train.py configs/eval_gpt2.py                       # OpenWebText, as nanoGPT reports it
#   python train.py configs/eval_gpt2.py --dataset=shakespeare  # or any GPT-2 BPE dataset
# Prints one "step 0: train loss ..., val loss ..." line and writes it to out_dir/metrics.jsonl.
# nanoGPT's README reports val loss 3.12 for this model on OpenWebText (as a point of comparison).
out_dir = "out-eval-gpt2"
init_from = "gpt2"
dataset = "openwebtext"
max_iters = 0
eval_iters = 25                # 25 x 8 windows of 1024 tokens per split
batch_size = 8
global_batch_size = 8
block_size = 1024
dropout = 0.0
resume = "never"
always_save_checkpoint = False
