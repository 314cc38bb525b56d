"""The suite's own tests run the Triton kernels in Triton's interpreter on a machine without a GPU.

``TRITON_INTERPRET=1`` must be set before ``triton`` is imported; this file is loaded before any test
module is (and in every pytest-xdist worker), so ``pytest tests`` covers the Triton tests on CPU with no
variable to remember. A value already set is kept (``TRITON_INTERPRET=0`` on a GPU machine).
"""

import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
