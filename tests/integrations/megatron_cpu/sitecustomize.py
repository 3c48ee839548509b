"""Test fixture: Megatron-core's CUDA calls as CPU no-ops in *every* process of a test run.

Put this directory on PYTHONPATH and set SOLOSAVE_TEST_MEGATRON_CPU=1: the ranks and the
worker that Megatron's persistent async caller spawns (whose first act is
``torch.cuda.set_device(rank % torch.cuda.device_count())``) then run on a CPU build of torch.
Tests only; the library never replaces anything of torch's.
"""

import os

if os.environ.get("SOLOSAVE_TEST_MEGATRON_CPU") == "1":
    import torch

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.device_count = lambda: 1
