"""Group-width-8 3x3 convolution: reference.py (spec), kernel.py (Triton), launcher.py (configs, checks,
launches, cost declarations), op.py (torch.ops.convfirstnet.gconv3x3 and its dgrad / wgrad, autograd)."""
