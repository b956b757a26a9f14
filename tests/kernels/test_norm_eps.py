"""The fused RMSNorm kernels with an eps that matters (the kernel tests use 1e-6 / 1e-5 on
rows of mean square ~1-9, where eps outside the square root is within tolerance)."""

from __future__ import annotations

import pytest
import torch

from lmprog_runtime.models.ops import TorchOps


def _naive(x, w, eps):
    x = x.double()
    return (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()).float()


@pytest.mark.parametrize("eps", [0.5, 1e-6])
def test_torch_ops_rms_norm_puts_eps_inside_the_root(eps):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=gen) * 0.5, torch.randn(64, generator=gen)
    torch.testing.assert_close(TorchOps.rms_norm(x, w, eps), _naive(x, w, eps))


@pytest.mark.parametrize("eps", [0.5, 1e-6])
def test_triton_rms_norm_puts_eps_inside_the_root(eps):
    pytest.importorskip("triton")
    from lmprog_runtime.models.triton_ops import TritonOps

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=gen) * 0.5, torch.randn(64, generator=gen)
    torch.testing.assert_close(TritonOps.rms_norm(x, w, eps), _naive(x, w, eps))
    residual = torch.randn(5, 64, generator=gen)
    want = _naive(residual + x, w, eps)
    out, _ = TritonOps().add_rms_norm(x, residual.clone(), w, eps)
    torch.testing.assert_close(out, want)
