"""ConvFirst training blocks (BatchNorm with batch statistics, drop-path, residual): reference.py (spec,
forward and backward), kernel.py (Triton), launcher.py (tiles, per-channel arithmetic, launches, cost
declarations), op.py (torch.ops.convfirstnet.convfirst_s1_train and its backward, autograd)."""
