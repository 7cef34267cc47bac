"""convfirst block: reference.py (spec), kernel.py (Triton), launcher.py (tile table, checks, launch, cost
declaration), op.py (torch.ops.convfirstnet.convfirst)."""
