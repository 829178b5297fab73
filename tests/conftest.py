"""Suite-wide test settings."""

from __future__ import annotations

import torch

# Tiny test models gain nothing from intra-op threads, and on a busy 2-core machine
# OpenMP workers spinning for a core make a 0.5 ms forward take 50 ms.
torch.set_num_threads(1)
