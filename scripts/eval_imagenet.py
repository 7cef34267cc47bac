#!/usr/bin/env python
"""Evaluate a ConvFirstNet on ImageNet (see convfirstnet/commands/eval/; also available as
`convfirstnet eval`). Several GPUs: torchrun --nproc_per_node=N scripts/eval_imagenet.py ..."""

import sys

if __name__ == "__main__":  # runs the installed package (pip install -e . in a checkout)
    from convfirstnet.commands.eval import main

    sys.exit(main())
