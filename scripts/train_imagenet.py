#!/usr/bin/env python
"""Train a ConvFirstNet with the paper's ImageNet recipe (see convfirstnet/tools/train_imagenet.py; also
available as `convfirstnet train`). Several GPUs: torchrun --nproc_per_node=N scripts/train_imagenet.py ..."""

import sys
from pathlib import Path

if __name__ == "__main__":
    repo_root = Path(__file__).resolve().parent.parent
    if (repo_root / "convfirstnet" / "__init__.py").is_file() and str(repo_root) not in sys.path:
        sys.path.insert(0, str(repo_root))  # run from a source checkout without installing

    from convfirstnet.tools.train_imagenet import main

    raise SystemExit(main())
