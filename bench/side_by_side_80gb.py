"""Device script: the peers' side-by-side (``.peers/moe_side_by_side.py``) with its fp8 reference built one
expert at a time, so that DeepSeek-V3's points below T=1024 fit an 80 GB card.

REPLAYMOE_PEERS=.peers PYTHONPATH=src:.peers python3 bench/side_by_side_80gb.py [the harness's options]

The harness checks ``fused_moe``'s fp8 output against an fp32 per-expert loop over weights dequantized from
e4m3 and their 128×128 block scales. It dequantizes every expert at once: 30 GB of fp32 for DeepSeek-V3's
w13 alone, more than an H100 holds beside the weights. On an 80 GB card every DeepSeek-V3 point at T ≤ 1024
then failed, its bf16 and fp8 timings included. Here the same dequantization runs per expert, as the loop
reads it (``naive_layer`` takes ``w[e]`` one expert at a time): the same reference values, the timed calls
unchanged. The harness and vLLM's kernel are not in this repository: ``../shared/peers/README.md``.
"""

import sys

import torch

sys.path.insert(0, ".peers")
import moe_side_by_side as S  # noqa: E402

_dequant_all = S.dequant_w


class ExpertwiseDequant:
    """Stands for ``dequant_w(q, s).to(dtype)`` [E, N, K] in the reference loop: ``shape``, and indexing by
    one expert, which dequantizes that expert alone."""

    def __init__(self, q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        self.q, self.s, self.dtype, self.shape = q, s, dtype, q.shape

    def to(self, dtype: torch.dtype) -> "ExpertwiseDequant":
        return ExpertwiseDequant(self.q, self.s, dtype)

    def __getitem__(self, e: int) -> torch.Tensor:
        return _dequant_all(self.q[e : e + 1], self.s[e : e + 1])[0].to(self.dtype)


if __name__ == "__main__":
    S.dequant_w = ExpertwiseDequant
    S.main()
