"""mbconv block: reference.py (spec), kernel.py (Triton), launcher.py (geometry, checks, launches, cost
declarations), op.py (torch.ops.convfirstnet.mbconv)."""
