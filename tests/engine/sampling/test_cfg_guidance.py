"""CFGDenoiser: one batched call for cond + uncond, no uncond pass at cfg 1, token-length matching."""

import pytest
import torch

from engine.sampling.guidance import CFGDenoiser, Conditioning, match_token_lengths


class RecordingModel:
    """Records every call; output depends on x, sigma, the mean of each row's context and y."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, sigma, context=None, y=None, **extra):
        self.calls.append({"batch": x.shape[0], "context": context.clone(),
                           "y": None if y is None else y.clone()})
        shift = context.mean(dim=(1, 2)).reshape(-1, 1, 1, 1)  # (B, 1, 1, 1)
        if y is not None:
            shift = shift + y.sum(dim=1).reshape(-1, 1, 1, 1)
        return x * 0.5 + shift + sigma.reshape(-1, 1, 1, 1)


def _cond(value: float, tokens: int = 77, y: float | None = None) -> Conditioning:
    context = torch.full((1, tokens, 8), value)
    context[:, 0] += 1.0  # make the first token differ so repetition is visible
    return Conditioning(context, None if y is None else torch.full((1, 4), y))


def test_cfg_batches_cond_and_uncond_in_one_model_call_and_mixes_them():
    model = RecordingModel()
    guided = CFGDenoiser(model, _cond(1.0), _cond(-2.0), cfg_scale=7.5)
    x, sigma = torch.randn(2, 4, 8, 8), torch.tensor([3.0, 3.0])
    out = guided(x, sigma)
    assert len(model.calls) == 1 and model.calls[0]["batch"] == 4
    reference_model = RecordingModel()  # the same guidance computed by two separate calls
    cond = reference_model(x, sigma, context=_cond(1.0).context.repeat(2, 1, 1))
    uncond = reference_model(x, sigma, context=_cond(-2.0).context.repeat(2, 1, 1))
    assert torch.allclose(out, uncond + 7.5 * (cond - uncond), atol=1e-5)


def test_cfg_one_makes_exactly_one_call_per_step_with_batch_one():
    model = RecordingModel()
    guided = CFGDenoiser(model, _cond(1.0), _cond(-2.0), cfg_scale=1.0)
    for sigma in (5.0, 2.0, 0.5):
        guided(torch.randn(1, 4, 8, 8), torch.tensor([sigma]))
    assert [c["batch"] for c in model.calls] == [1, 1, 1]
    assert all(torch.equal(c["context"], _cond(1.0).context) for c in model.calls)


def test_cond_and_uncond_of_different_token_lengths_are_repeated_to_their_lcm():
    model = RecordingModel()
    guided = CFGDenoiser(model, _cond(1.0, tokens=154), _cond(-2.0, tokens=77), cfg_scale=5.0)
    guided(torch.randn(1, 4, 8, 8), torch.tensor([1.0]))
    context = model.calls[0]["context"]
    assert context.shape == (2, 154, 8)
    assert torch.equal(context[1], _cond(-2.0).context[0].repeat(2, 1))  # uncond chunk repeated twice
    assert [t.shape[1] for t in match_token_lengths([torch.zeros(1, 77, 2), torch.zeros(1, 231, 2),
                                                     torch.zeros(1, 154, 2)])] == [462, 462, 462]


def test_sdxl_y_vectors_are_concatenated_with_the_contexts():
    model = RecordingModel()
    guided = CFGDenoiser(model, _cond(1.0, y=0.25), _cond(0.0, y=-0.5), cfg_scale=3.0)
    guided(torch.randn(1, 4, 8, 8), torch.tensor([1.0]))
    assert torch.equal(model.calls[0]["y"], torch.cat([torch.full((1, 4), 0.25), torch.full((1, 4), -0.5)]))


def test_mismatched_y_and_missing_negative_are_clear_errors():
    with pytest.raises(ValueError, match="y"):
        CFGDenoiser(RecordingModel(), _cond(1.0, y=0.25), _cond(0.0), 3.0)(torch.randn(1, 4, 8, 8),
                                                                            torch.tensor([1.0]))
    with pytest.raises(ValueError, match="negative"):
        CFGDenoiser(RecordingModel(), _cond(1.0), None, 3.0)
    with pytest.raises(ValueError, match="batch, tokens, channels"):
        Conditioning(torch.zeros(77, 768))


def test_keep_uncond_runs_the_negative_pass_even_at_cfg_one_and_exposes_it():
    model = RecordingModel()
    guided = CFGDenoiser(model, _cond(1.0), _cond(-2.0), cfg_scale=1.0)
    guided.keep_uncond = True
    x = torch.randn(1, 4, 8, 8)
    out = guided(x, torch.tensor([1.0]))
    assert model.calls[0]["batch"] == 2
    expected_uncond = RecordingModel()(x, torch.tensor([1.0]), context=_cond(-2.0).context)
    assert torch.allclose(guided.last_uncond_denoised, expected_uncond, atol=1e-6)
    expected_cond = RecordingModel()(x, torch.tensor([1.0]), context=_cond(1.0).context)
    assert torch.allclose(out, expected_cond, atol=1e-6)
