"""The Triton decode kernel against its torch twin (interpreter on CPU; compiled where CUDA exists)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvresearch.device_check import interpreter_refuses

pytestmark = pytest.mark.compat  # also run on the GPU image's versions (make compat)

SCRIPT = textwrap.dedent(
    """
    import torch
    from kvresearch.ops.attention import ragged_attention
    from kvresearch.ops.triton_decode import ragged_decode

    device = "{device}"
    g = torch.Generator().manual_seed(0)
    for hq, hkv, d, t, window in [(6, 3, 16, 1, None), (4, 2, 32, 3, None), (8, 2, 16, 2, 7)]:
        lengths = torch.tensor([5 + 37 * h for h in range(hkv)])
        lengths[0] = 0 if window is None and t == 1 else lengths[0]  # an empty head is fine
        starts = torch.cumsum(lengths, 0) - lengths
        cap = int(lengths.sum())
        keys, values = torch.randn(cap, d, generator=g), torch.randn(cap, d, generator=g)
        bias = torch.randn(cap, generator=g)
        bias[::7] = float("-inf")  # evicted entries
        pos = torch.cat([torch.randperm(150, generator=g)[:n].sort().values for n in lengths.tolist()])
        q = torch.randn(hq, t, d, generator=g)
        q_pos = torch.arange(140 - t, 140)
        args = [x.to(device) for x in (q, q_pos, keys, values, bias, pos)] + [starts, lengths, 0.25]
        ref = ragged_attention(*args, window=window)
        out = ragged_decode(*args, window=window, block_n=16)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    print("kernel ok")
    """
)


@pytest.mark.skipif(interpreter_refuses() is not None, reason=str(interpreter_refuses()))
def test_triton_kernel_matches_torch_reference_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(device="cpu")], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kernel ok" in result.stdout


@pytest.mark.gpu
def test_triton_kernel_compiled_on_cuda() -> None:
    exec(SCRIPT.format(device="cuda"), {})
    assert torch.cuda.is_available()
