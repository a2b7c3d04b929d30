import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter. Triton reads this when a kernel is
# defined, so it is set before any test module imports prefix_cache.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
