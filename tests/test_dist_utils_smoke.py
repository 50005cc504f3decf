import torch
import torch.distributed as dist
from dist_utils import run_distributed

def _body(rank, world):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == world * (world + 1) / 2

def _fail(rank, world):
    assert rank == 0, "boom"

def test_run():
    run_distributed(_body, 2)
    run_distributed(_body, 4)
    import pytest
    with pytest.raises(AssertionError, match="boom"):
        run_distributed(_fail, 2)
