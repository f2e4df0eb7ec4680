"""The shared trainer for modules on a frozen target: the loop fits, the features match the target."""

from __future__ import annotations

import torch

from methods.heads import trainer
from methods.models import random_llama
from specsim.config import ModelConfig

TINY = ModelConfig(
    vocab_size=300, hidden_size=32, n_layers=3, n_heads=4, n_kv_heads=4, intermediate_size=64,
    context_length=64, draft_n_layers=0,
)


def test_fit_reduces_a_regression_loss_and_records_every_step():
    g = torch.Generator().manual_seed(0)
    w_true = torch.randn(8, 4, generator=g)
    lin = torch.nn.Linear(8, 4, bias=False)

    def batch(gen):
        x = torch.randn(64, 8, generator=gen)
        return x, x @ w_true

    cfg = trainer.LoopConfig(steps=150, lr=0.05, autocast=False, desc="test")
    out = trainer.fit(lin.parameters(), batch, lambda b: ((lin(b[0]) - b[1]) ** 2).mean(), cfg, g)
    assert len(out.losses) == 150 and out.seconds > 0
    assert out.losses[-1] < 0.01 * out.losses[0]


def test_fit_trains_under_inference_mode_and_clips_only_the_named_parameters():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    cfg = trainer.LoopConfig(steps=1, lr=1.0, schedule="constant", clip=1e-6, autocast=False)
    with torch.inference_mode():  # a drafter built inside a measurement run
        trainer.fit([a, b], lambda gen: None, lambda _: (a * 100).sum() + (b * 100).sum(), cfg,
                    torch.Generator(), clip_params=[a])
    # Adam's first step moves each coordinate by ~lr whatever the scale, so compare the gradients instead
    assert a.grad.norm() <= 1e-6 * 1.001 and torch.allclose(b.grad, torch.full((3,), 100.0))


def test_target_features_match_the_target():
    model = random_llama(TINY, seed=1).eval()
    ids = torch.randint(0, 300, (3, 10), generator=torch.Generator().manual_seed(2))
    f = trainer.target_features(model, ids, layers=(0, 2), logp=True, batch=2)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    assert f.hidden.shape == (3, 10, 32) and f.layers.shape == (3, 10, 64)
    torch.testing.assert_close(f.greedy, out.logits.argmax(-1))
    torch.testing.assert_close(f.logp, out.logits.float().log_softmax(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(f.layers[..., :32], out.hidden_states[1])
    torch.testing.assert_close(f.layers[..., 32:], f.hidden)  # the last layer's tap is after the final norm
