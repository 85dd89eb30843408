"""ktlong: long-context LLM inference on one GPU plus host memory."""

import os

__version__ = "0.1.0"

# The device budget is planned to within a GiB, and a session's buffers come and go in sizes that
# differ by turn (resident history, prefetch pages, graphs). PyTorch's default allocator keeps
# freed blocks cut to their old sizes and counts them against the cap: the follow-up bench's
# second session at 128K held 0.7-1.3 GiB reserved and unused and ran out of memory at 24 GiB.
# Expandable segments map memory in pages that any later size reuses. A value the user set wins.
if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
