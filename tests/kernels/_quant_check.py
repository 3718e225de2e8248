"""Shared assertion of the int8-producing kernel tests: equal to the reference except at rounding ties."""

import torch


def assert_int8_match(q, scale, q_ref, scale_ref, y64, tie_tol=2e-3, max_frac=1e-3):
    """q, scale: kernel output; q_ref, scale_ref: the reference's; y64: the pre-quantization values
    in float64 (same shape as q). Mismatches must be off by one, sit within `tie_tol` of a .5 tie of
    y64 * 127 / amax, and be rare; scales equal the reference's to float rounding."""
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert q.shape == q_ref.shape and scale.shape == scale_ref.shape
    torch.testing.assert_close(scale.cpu(), scale_ref.cpu(), rtol=2e-6, atol=0)
    q, q_ref, y64 = q.cpu(), q_ref.cpu(), y64.cpu()
    diff = (q.int() - q_ref.int())
    bad = diff != 0
    v = y64 * (127.0 / y64.abs().amax(-1, keepdim=True).clamp(min=1e-5))  # pre-rounding values
    dist_to_tie = ((v - v.floor()) - 0.5).abs()
    assert diff.abs().max().item() <= 1
    assert (dist_to_tie[bad] < tie_tol).all(), "an int8 mismatch that is not a rounding tie"
    assert bad.sum().item() <= max(2, max_frac * q.numel()), f"{bad.sum().item()} tie mismatches"
    assert q.abs().max().item() == 127  # the row max maps to +-127 (symmetric)
    assert (q != 0).float().mean().item() > 0.5  # not a degenerate all-zero output
