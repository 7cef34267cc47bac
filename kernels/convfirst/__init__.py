"""convfirst block: reference.py (spec), kernel.py (Triton), op.py (torch.ops.convfirstnet.convfirst)."""
