"""How many plain steps one verify may decode (multi-step decoding).

A constant of the verify contract that the orchestrator's policy also checks its
``plain_steps`` against; it lives alone so that the policy package imports no torch.
"""

MAX_STEPS = 64  # more would hold the replica's other calls waiting too long
