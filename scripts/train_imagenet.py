#!/usr/bin/env python
"""Train a ConvFirstNet with the paper's ImageNet recipe (see convfirstnet/commands/train/; also
available as `convfirstnet train`). Several GPUs: torchrun --nproc_per_node=N scripts/train_imagenet.py ..."""

import sys

if __name__ == "__main__":  # runs the installed package (pip install -e . in a checkout)
    from convfirstnet.commands.train import main

    sys.exit(main())
