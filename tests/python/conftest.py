import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

# Backends are checked on the CPU everywhere and on the GPU where there is one.
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
