"""``rows_at`` picks the rows ``torch.gather`` picks, from tensors laid out as the prefill and stage 2 lay them out."""
import pytest
import torch

from pcs.tensor_rows import rows_at


def layouts(dtype):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, 40, 3, 8, generator=g).to(dtype)            # (1, n, H, d), as a projection's output
    yield "contiguous", torch.randn(3, 40, 8, generator=g).to(dtype)
    yield "transposed", base.transpose(1, 2)[0]                      # a prefill's values: (H, n, d) view
    yield "prefix slice", base.transpose(1, 2)[0][:, :31]            # stage 2's prefix of them
    yield "head slice", torch.randn(5, 40, 8, generator=g).to(dtype)[1:4]
    yield "expanded", torch.randn(1, 40, 8, generator=g).to(dtype).expand(3, -1, -1)
    yield "strided vectors", torch.randn(3, 40, 16, generator=g).to(dtype)[..., ::2]    # falls back to gather


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_at_picks_what_gather_picks(dtype):
    g = torch.Generator().manual_seed(1)
    for name, x in layouts(dtype):
        for c in (0, 1, 17):
            idx = torch.randint(0, x.shape[1], (x.shape[0], c), generator=g)
            want = x.gather(1, idx[..., None].expand(-1, -1, x.shape[2]))
            got = rows_at(x, idx)
            assert got.shape == want.shape and torch.equal(got, want), name
            assert torch.equal(got, torch.stack([x[h, idx[h]] for h in range(x.shape[0])])), name
