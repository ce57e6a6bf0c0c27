"""The packed-weight matmul must compute F.linear: same values (to rounding), the current weight
after in-place updates, gradients when training, and plain F.linear when switched off."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from vocabspec.runtime import linear as linear_module
from vocabspec.runtime.linear import Linear, linear


def _close(a, b, dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol * float(b.float().abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 12, 130])
def test_matches_f_linear(dtype, rows):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 64, generator=generator).to(dtype)
    bias = torch.randn(200, generator=generator).to(dtype)
    x = torch.randn(rows, 64, generator=generator).to(dtype)
    with torch.inference_mode():
        assert _close(linear(x, weight), F.linear(x, weight), dtype)
        assert _close(linear(x, weight, bias), F.linear(x, weight, bias), dtype)
        assert linear(x[None], weight).shape == (1, rows, 200)


def test_follows_in_place_updates_and_reallocation():
    weight = torch.randn(50, 16)
    x = torch.randn(2, 16)
    with torch.no_grad():
        before = linear(x, weight)
        weight.mul_(2)                       # an optimizer step changes weights in place
        assert torch.allclose(linear(x, weight), 2 * before, rtol=1e-5, atol=1e-5)
        other = weight.clone() + 1           # a new tensor must never reuse another's pack
        assert torch.allclose(linear(x, other), F.linear(x, other), rtol=1e-5, atol=1e-5)


def test_gradients_flow_when_training():
    layer = Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    layer(x).sum().backward()
    reference = nn.Linear(16, 8)
    reference.load_state_dict(layer.state_dict())
    x2 = x.detach().clone().requires_grad_(True)
    reference(x2).sum().backward()
    assert torch.allclose(layer.weight.grad, reference.weight.grad)
    assert torch.allclose(x.grad, x2.grad)
    assert set(layer.state_dict()) == {"weight", "bias"}


def test_switch_off_gives_plain_f_linear(monkeypatch):
    monkeypatch.setenv("VOCABSPEC_PACKED_LINEAR", "0")
    assert not linear_module.packing_enabled()
    weight, x = torch.randn(30, 8), torch.randn(5, 8)
    with torch.inference_mode():
        assert torch.equal(linear(x, weight), F.linear(x, weight))
