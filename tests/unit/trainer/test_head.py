"""The trainer's head, a chunk of tokens at a time (`head_logprobs`): the same log-probs, entropies and gradients as
the whole-batch logits, and at a real vocabulary a peak far below the [B, T, V] logits it never builds."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from jetroll.shared.model.args import ModelArgs
from jetroll.shared.model.model import CausalLM
from jetroll.shared.rl import passes
from jetroll.shared.rl.loss import token_entropy, token_logprobs
from jetroll.shared.rl.passes import head_logprobs


def small_model(tied: bool) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(ModelArgs(vocab_size=53, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                               intermediate_size=64, max_position_embeddings=32, tie_word_embeddings=tied))
    model.mask_ids_past(47)  # six ids without a string: -inf logits, p = 0
    return model


def whole_batch(model: CausalLM, hidden: torch.Tensor, targets: torch.Tensor,
                temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model.logits(hidden)
    return token_logprobs(logits, targets, temperature), token_entropy(logits, temperature)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 1000])
def test_chunks_give_the_whole_batchs_logprobs_entropies_and_gradients(
        monkeypatch: pytest.MonkeyPatch, tied: bool, chunk_tokens: int) -> None:
    model = small_model(tied)
    monkeypatch.setattr(passes, "LOGIT_CHUNK_ELEMENTS", chunk_tokens * model.args.vocab_size)
    ids = torch.randint(0, 47, (3, 9))
    targets = torch.randint(0, 47, (3, 9))
    temperature = torch.tensor([1.0, 0.7, 1.3])
    grad_logp, grad_entropy = torch.randn(3, 9), torch.randn(3, 9)
    results = []
    for head in (whole_batch, head_logprobs):
        model.zero_grad(set_to_none=True)
        hidden = model.hidden(ids)
        hidden.retain_grad()
        logp, entropy = head(model, hidden, targets, temperature)
        ((logp * grad_logp).sum() + (entropy * grad_entropy).sum()).backward()
        results.append((logp.detach(), entropy.detach(), hidden.grad, model.lm_head.weight.grad,
                        model.model.layers[0].mlp.down_proj.weight.grad))
    for expected, chunked in zip(*results, strict=True):
        torch.testing.assert_close(chunked, expected, rtol=1e-5, atol=1e-6)


def test_the_entropy_alone_or_the_logprob_alone_gets_its_own_gradient() -> None:
    model = small_model(tied=False)
    ids, targets, temperature = torch.randint(0, 47, (2, 5)), torch.randint(0, 47, (2, 5)), torch.tensor([1.0, 0.5])
    for pick in (0, 1):
        grads = []
        for head in (whole_batch, head_logprobs):
            model.zero_grad(set_to_none=True)
            head(model, model.hidden(ids), targets, temperature)[pick].sum().backward()
            grads.append(model.lm_head.weight.grad.clone())
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)


def test_a_no_grad_pass_takes_the_models_own_logits_on_the_exact_backend() -> None:
    from jetroll.shared.numerics import Numerics

    model = small_model(tied=True)
    model.precision = Numerics(backend="exact")
    ids, targets = torch.randint(0, 47, (2, 6)), torch.randint(0, 47, (2, 6))
    with torch.no_grad():
        hidden = model.hidden(ids)
        logp, _ = head_logprobs(model, hidden, targets, torch.ones(2))
        expected = token_logprobs(model.logits(hidden), targets, 1.0, is_exact=True)
    assert torch.equal(logp, expected)


PEAK = textwrap.dedent("""
    import json, resource, sys
    import torch
    from jetroll.shared.rl.passes import head_logprobs
    from jetroll.shared.config.precision import PrecisionConfig
    from jetroll.shared.config.trainer import TrainerConfig
    from jetroll.shared.model.args import ModelArgs
    from jetroll.shared.model.model import CausalLM
    from jetroll.shared.rl.loss import ppo_loss

    batch, seq, vocab, width = 8, 512, 151_936, int(sys.argv[1])
    args = ModelArgs(vocab_size=vocab, hidden_size=width, num_layers=1, num_heads=2, num_kv_heads=1,
                     intermediate_size=64, max_position_embeddings=512, tie_word_embeddings=True)
    with torch.device("meta"):
        model = CausalLM(args)
    model.lm_head = torch.nn.Linear(width, vocab, bias=False)  # the only weight the head touches
    weight = model.lm_head.weight
    adam = [torch.zeros_like(weight), torch.zeros_like(weight)]  # the optimizer's two moments
    hidden = torch.randn(batch, seq, width, requires_grad=True)
    targets = torch.randint(0, vocab, (batch, seq))
    behavior = torch.full((batch, seq), -11.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    logp, entropy = head_logprobs(model, hidden, targets, torch.ones(batch))
    config = TrainerConfig(entropy_coef=0.01)
    loss, _ = ppo_loss(logp, logp.detach(), behavior, torch.randn(batch), torch.ones(batch, seq), config,
                       correction=PrecisionConfig(), entropy=entropy)
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert weight.grad is not None and hidden.grad is not None and torch.isfinite(weight.grad).all()
    print(json.dumps({"above": peak - before - weight.grad.nbytes - hidden.grad.nbytes,
                      "logits": batch * seq * vocab * 4}))
""")


@pytest.mark.slow
@pytest.mark.integration
def test_a_real_vocabularys_head_peaks_far_below_its_logits() -> None:
    """8 x 512 tokens at Qwen2.5's vocabulary (151,936 ids): the log-prob, entropy, loss and backward pass peaks at
    most 0.5 GB above the weights, their gradient and Adam's state, where the logits alone would be 2.5 GB."""
    out = subprocess.run([sys.executable, "-c", PEAK, "896"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    measured = json.loads(out.stdout)
    assert measured["logits"] > 2.4e9
    assert measured["above"] <= 0.5e9, measured
