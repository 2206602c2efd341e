import math

import pytest
import torch

from model import GPT, GPTConfig, peak_flops_for


def small_model(seed=0, dtype=torch.float32, **overrides):
    """A tiny GPT in eval mode. Greedy comparisons run in float64 so that the cached and the
    recomputed paths cannot disagree on a near-tie of two logits."""
    torch.manual_seed(seed)
    args = dict(block_size=32, vocab_size=97, n_layer=2, n_head=4, n_embd=32, dropout=0.0, bias=True)
    args.update(overrides)
    return GPT(GPTConfig(**args)).to(dtype).eval()


def reference_greedy(model, idx, max_new_tokens):
    """Greedy decoding without a cache: each step recomputes its whole context with forward().

    The context rule is the one generate() documents: it grows by one token per step and, once
    it would exceed block_size, restarts from the last block_size // 2 tokens.
    """
    block_size = model.config.block_size
    n_context = min(idx.size(1), block_size)
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -n_context:])
        idx = torch.cat((idx, logits[:, -1, :].argmax(dim=-1, keepdim=True)), dim=1)
        n_context += 1
        if n_context > block_size:
            n_context = max(1, block_size // 2)
    return idx


def random_tokens(batch, length, vocab_size, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=g)


def test_gpt2_small_has_124m_parameters():
    # On the meta device nothing is allocated or initialised: only the shapes exist.
    with torch.device('meta'):
        model = GPT(GPTConfig(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768, bias=True))
    unique = {id(p): p for p in model.parameters()}.values()
    assert sum(p.numel() for p in unique) == 124_439_808
    assert model.get_num_params(non_embedding=False) == 124_439_808
    assert model.get_num_params() == 124_439_808 - 1024 * 768  # without the position embeddings


def test_initial_loss_is_close_to_log_vocab_size():
    # With weights ~ N(0, 0.02) the logits start near zero, so the predicted distribution is
    # close to uniform and the cross-entropy of any target is close to -ln(1/V) = ln(V).
    model = small_model(vocab_size=1000, n_layer=4, n_embd=64, block_size=64)
    idx = random_tokens(8, 64, 1000, seed=2)
    targets = random_tokens(8, 64, 1000, seed=3)
    _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(1000)) < 0.2


def test_forward_without_targets_returns_last_position_logits():
    model = small_model()
    idx = random_tokens(2, 10, 97)
    full_logits, loss = model(idx, torch.zeros_like(idx))
    last_logits, no_loss = model(idx)
    assert full_logits.shape == (2, 10, 97) and loss is not None
    assert last_logits.shape == (2, 1, 97) and no_loss is None
    torch.testing.assert_close(last_logits, full_logits[:, [-1], :])


def test_a_position_sees_only_the_tokens_before_it():
    model = small_model()
    idx = random_tokens(1, 12, 97)
    changed = idx.clone()
    changed[0, 8] = (idx[0, 8] + 1) % 97
    before, _ = model(idx, torch.zeros_like(idx))
    after, _ = model(changed, torch.zeros_like(idx))
    torch.testing.assert_close(before[:, :8], after[:, :8], rtol=0, atol=0)
    assert before[:, 8:].ne(after[:, 8:]).any(dim=-1).all()  # from position 8 on, each position's logits change


def test_loss_ignores_targets_of_minus_one():
    model = small_model()
    idx = random_tokens(2, 10, 97)
    targets = random_tokens(2, 10, 97, seed=4)
    masked = targets.clone()
    masked[:, 5:] = -1
    _, loss_masked = model(idx, masked)
    logits, _ = model(idx, targets)
    expected = torch.nn.functional.cross_entropy(logits[:, :5].reshape(-1, 97), targets[:, :5].reshape(-1))
    torch.testing.assert_close(loss_masked, expected)


def test_forward_rejects_sequence_longer_than_block_size():
    model = small_model(block_size=8)
    with pytest.raises(AssertionError, match="block_size is only 8"):
        model(random_tokens(1, 9, 97))


@pytest.mark.parametrize("prompt_len", [1, 7, 32])
def test_cached_greedy_generation_matches_full_recompute(prompt_len):
    model = small_model(dtype=torch.float64)
    idx = random_tokens(3, prompt_len, 97, seed=prompt_len)
    max_new_tokens = max(1, 32 - prompt_len)  # up to a full block (the 32-token prompt adds one)
    out = model.generate(idx, max_new_tokens, temperature=0)
    assert out.shape == (3, prompt_len + max_new_tokens)
    assert torch.equal(out[:, :prompt_len], idx)
    assert torch.equal(out, reference_greedy(model, idx, max_new_tokens))


@pytest.mark.parametrize("block_size", [16, 15, 1])  # (1: the half block is no token; one is kept)
def test_generation_past_block_size_rebuilds_cache_and_matches_reference(block_size):
    model = small_model(dtype=torch.float64, block_size=block_size)
    idx = random_tokens(2, 5, 97)
    out = model.generate(idx, 60, temperature=0)  # several rebuilds
    assert out.shape == (2, 65)
    assert torch.equal(out, reference_greedy(model, idx, 60))


@pytest.mark.parametrize("block_size", [8, 15])
def test_each_cached_step_sees_the_context_the_rule_gives(monkeypatch, block_size):
    """Each step's logits are a full forward over reference_greedy's context. Random tokens are fed in:
    a random model's greedy output repeats one token, which cannot show what context a step saw."""
    import model as model_module
    model, seen = small_model(dtype=torch.float64, block_size=block_size), []
    idx, fed = random_tokens(2, 5, 97), random_tokens(2, 30, 97, seed=2)
    monkeypatch.setattr(model_module, "_sample", lambda logits, *args: seen.append(logits) or
                        fed[:, len(seen) - 1:len(seen)])
    out, n_context = model.generate(idx, 30), 5
    assert torch.equal(out[:, 5:], fed) and len(seen) == 30
    for step, logits in enumerate(seen):
        assert torch.allclose(logits, model(out[:, :5 + step][:, -n_context:])[0][:, -1]), step
        n_context = n_context + 1 if n_context < block_size else block_size // 2  # past it: its last half again


def test_generation_crops_a_prompt_longer_than_block_size():
    model = small_model(dtype=torch.float64, block_size=16)
    idx = random_tokens(2, 40, 97)
    out = model.generate(idx, 20, temperature=0)
    assert out.shape == (2, 60) and torch.equal(out[:, :40], idx)
    assert torch.equal(out, reference_greedy(model, idx, 20))


def test_embeddings_are_tied_and_stay_tied_after_load_state_dict():
    model = small_model(seed=0)
    assert model.transformer.wte.weight is model.lm_head.weight
    other = small_model(seed=1)
    model.load_state_dict(other.state_dict())
    assert model.transformer.wte.weight.data_ptr() == model.lm_head.weight.data_ptr()
    torch.testing.assert_close(model.lm_head.weight, other.transformer.wte.weight)
    with torch.no_grad():
        model.transformer.wte.weight[0, 0] = 123.0
    assert model.lm_head.weight[0, 0].item() == 123.0


def test_state_dict_keys_use_gpt2_names():
    keys = set(small_model(n_layer=1).state_dict())
    assert keys == {
        'transformer.wte.weight', 'transformer.wpe.weight',
        'transformer.h.0.ln_1.weight', 'transformer.h.0.ln_1.bias',
        'transformer.h.0.attn.c_attn.weight', 'transformer.h.0.attn.c_attn.bias',
        'transformer.h.0.attn.c_proj.weight', 'transformer.h.0.attn.c_proj.bias',
        'transformer.h.0.ln_2.weight', 'transformer.h.0.ln_2.bias',
        'transformer.h.0.mlp.c_fc.weight', 'transformer.h.0.mlp.c_fc.bias',
        'transformer.h.0.mlp.c_proj.weight', 'transformer.h.0.mlp.c_proj.bias',
        'transformer.ln_f.weight', 'transformer.ln_f.bias',
        'lm_head.weight',
    }


def test_without_bias_there_are_no_bias_parameters():
    keys = small_model(bias=False).state_dict()
    assert not any(k.endswith('.bias') for k in keys)


def test_init_scales_residual_projections_by_depth():
    model = small_model(n_layer=8, n_embd=256, n_head=4)
    expected = 0.02 / math.sqrt(2 * 8)
    for name, p in model.named_parameters():
        if name.endswith('c_proj.weight'):
            assert abs(p.std().item() - expected) < 0.15 * expected, name
        elif name.endswith('c_fc.weight'):
            assert abs(p.std().item() - 0.02) < 0.003, name
        elif name.endswith('.bias'):
            assert torch.all(p == 0), name


def test_optimizer_puts_every_parameter_in_one_group_and_decays_only_matrices():
    model = small_model()
    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-3, betas=(0.9, 0.95),
                                           device_type='cpu')
    grouped = [id(p) for group in optimizer.param_groups for p in group['params']]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())  # each exactly once
    for group in optimizer.param_groups:
        for p in group['params']:
            assert group['weight_decay'] == (0.1 if p.dim() >= 2 else 0.0)
    assert optimizer.defaults['fused'] is True
    # and a fused step on CPU runs and moves the weights
    idx = random_tokens(2, 16, 97)
    before = model.lm_head.weight.detach().clone()
    _, loss = model(idx, idx)
    loss.backward()
    optimizer.step()
    assert not torch.equal(before, model.lm_head.weight)


def test_sampling_is_reproducible_with_a_seeded_generator():
    model = small_model()
    idx = random_tokens(2, 4, 97)
    a = model.generate(idx, 40, temperature=1.0, generator=torch.Generator().manual_seed(7))
    b = model.generate(idx, 40, temperature=1.0, generator=torch.Generator().manual_seed(7))
    c = model.generate(idx, 40, temperature=1.0, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_temperature_zero_and_top_k_one_are_greedy():
    model = small_model(dtype=torch.float64)
    idx = random_tokens(2, 4, 97)
    greedy = reference_greedy(model, idx, 20)
    assert torch.equal(model.generate(idx, 20, temperature=0), greedy)
    # a temperature that is 0 in float32 once divided the logits by 0: NaN probabilities, a traceback
    assert torch.equal(model.generate(idx, 20, temperature=1e-300, generator=torch.Generator()), greedy)
    import model as model_module  # a temperature just above that, on GPT-2's large negative logits: no overflow to -inf
    logits = torch.randn(2, 11, generator=torch.Generator().manual_seed(0)) * 4 - 100
    assert torch.equal(model_module._sample(logits, 2e-38, None, None), logits.argmax(-1, keepdim=True))
    for temperature in (1.0, 1e300):  # (1e300 made every logit 0 before top_k: it kept them all)
        top1 = model.generate(idx, 20, temperature=temperature, top_k=1, generator=torch.Generator().manual_seed(0))
        assert torch.equal(top1, greedy)


def test_sampling_divides_the_logits_by_the_temperature(monkeypatch):
    """0.5 sharpens, 2 flattens (1.0, the only temperature sampled elsewhere, cannot tell * from /)."""
    import model
    seen = []
    monkeypatch.setattr(model.torch, "multinomial", lambda probs, num_samples, generator: seen.append(probs) or
                        probs.argmax(-1, keepdim=True))
    for temperature in (0.5, 2.0):
        model._sample(torch.tensor([[0.0, 1.0]]), temperature, None, None)
    expected = [torch.softmax(torch.tensor([[0.0, scaled]]), -1) for scaled in (2.0, 0.5)]
    assert all(map(torch.allclose, seen, expected)), seen


def test_top_k_larger_than_vocab_is_clamped():
    model = small_model()
    out = model.generate(random_tokens(2, 4, 97), 10, top_k=10_000, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 14) and out.min() >= 0 and out.max() < 97


@pytest.mark.parametrize("kwargs", [dict(max_new_tokens=0), dict(max_new_tokens=-1),
                                    dict(max_new_tokens=5, temperature=-0.5),
                                    dict(max_new_tokens=5, temperature=float("nan")),
                                    dict(max_new_tokens=5, top_k=0)])
def test_generate_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        small_model().generate(random_tokens(1, 3, 97), **kwargs)


def test_estimate_mfu_is_none_without_a_known_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    assert small_model().estimate_mfu(fwdbwd_per_iter=8, dt=0.1) is None


def test_estimate_mfu_with_an_explicit_peak():
    model = small_model()  # L=2, H=4, Q=8, T=32
    N = model.get_num_params()
    flops_per_token = 6 * N + 12 * 2 * 4 * 8 * 32
    expected = flops_per_token * 32 * 8 / 0.5 / 1e12
    assert model.estimate_mfu(fwdbwd_per_iter=8, dt=0.5, peak_flops=1e12) == pytest.approx(expected)
    assert 0 < expected < 1


def test_peak_flops_table():
    assert peak_flops_for('NVIDIA A100-SXM4-80GB') == 312e12
    assert peak_flops_for('NVIDIA H100 80GB HBM3') == 989e12
    assert peak_flops_for('NVIDIA H100 PCIe') < 989e12
    assert peak_flops_for('NVIDIA H200') == 989e12
    assert peak_flops_for('cpu') is None
    assert peak_flops_for('NVIDIA H200 NVL') == 835e12 and peak_flops_for('NVIDIA GH200 480GB') == 989e12
    assert peak_flops_for('NVIDIA RTX A1000 6GB Laptop GPU') is None  # (once A100's 312 TFLOP/s: "A100" in it)


def test_a_short_block_refuses_longer_input_and_generates_past_it():
    # (crop_block_size is gone: GPT-2's position table is cropped when its weights are loaded)
    model = small_model(block_size=8)
    assert model.config.block_size == 8
    assert model.transformer.wpe.weight.shape == (8, 32)
    idx = random_tokens(2, 8, 97)
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 8, 97) and torch.isfinite(loss)
    with pytest.raises(AssertionError):
        model(random_tokens(2, 9, 97))
    assert model.generate(idx, 12, temperature=0).shape == (2, 20)


@pytest.mark.parametrize("shape", [dict(), dict(bias=False, pad_vocab_to=64), dict(n_layer=3, n_embd=48, n_head=4)])
def test_the_parameter_count_needs_no_model(shape):
    config = GPTConfig(**{"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 97, **shape})
    assert config.n_params == sum(p.numel() for p in GPT(config).parameters())


def test_a_padded_vocabulary_changes_nothing_the_model_computes():
    # 65 tokens padded to 128 rows: the same init for the real rows, the same losses step after
    # step, logits over the real vocabulary only, and padding rows that stay zero
    runs = []
    for pad in (1, 64):
        model = small_model(vocab_size=65, pad_vocab_to=pad).train()
        optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), 'cpu')
        idx = random_tokens(4, 32, 65)
        losses = []
        for _ in range(5):
            logits, loss = model(idx, idx)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        runs.append((model, logits, losses))
    (plain, plain_logits, plain_losses), (padded, padded_logits, padded_losses) = runs
    assert padded.transformer.wte.weight.shape == (128, 32) and padded_logits.shape == plain_logits.shape
    assert padded.lm_head.weight is padded.transformer.wte.weight
    assert torch.all(padded.transformer.wte.weight[65:] == 0)
    assert padded.get_num_params() == plain.get_num_params()
    torch.testing.assert_close(padded_losses, plain_losses, rtol=1e-6, atol=0)
    for (name, a), b in zip(plain.named_parameters(), padded.parameters()):
        torch.testing.assert_close(b[:a.shape[0]], a, rtol=1e-5, atol=1e-6, msg=name)
    assert padded.generate(random_tokens(1, 3, 65), 5, temperature=1.0,
                           generator=torch.Generator().manual_seed(0)).max() < 65


def test_the_padding_mask_stays_inside_the_loss():
    # The logits returned are the output layer's own (a view), not a masked copy: a copy as an
    # output would be written out in full by the compiled loss kernel (3.3 GB per 32 x 1024
    # micro-batch of GPT-2), where the mask alone fuses into the loss.
    model = small_model(vocab_size=65, pad_vocab_to=64)
    seen = []
    model.lm_head.register_forward_hook(lambda m, i, out: seen.append(out))
    logits, _ = model(random_tokens(2, 8, 65), random_tokens(2, 8, 65, seed=1))
    assert logits.shape[-1] == 65 and logits.untyped_storage().data_ptr() == seen[0].untyped_storage().data_ptr()


def test_the_mlp_is_gpt2s_with_the_tanh_gelu():
    """GPT-2 was trained with GELU's tanh approximation. The exact GELU passed every test: with GPT-2's small
    weights the two differ in the logits by 2e-6, under the tolerance of the comparisons with transformers."""
    from model import MLP
    torch.manual_seed(0)
    mlp = MLP(GPTConfig(n_embd=8, bias=True, dropout=0.0))
    x = 3 * torch.randn(5, 8)
    h = x @ mlp.c_fc.weight.T + mlp.c_fc.bias
    gelu = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    torch.testing.assert_close(mlp(x), gelu @ mlp.c_proj.weight.T + mlp.c_proj.bias)
