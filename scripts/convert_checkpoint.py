#!/usr/bin/env python
"""Convert a training checkpoint into a verified ConvFirstNet weight file (see
convfirstnet/tools/convert_checkpoint.py; also available as `convfirstnet convert`)."""

import sys
from pathlib import Path

if __name__ == "__main__":
    repo_root = Path(__file__).resolve().parent.parent
    if (repo_root / "convfirstnet" / "__init__.py").is_file() and str(repo_root) not in sys.path:
        sys.path.insert(0, str(repo_root))  # run from a source checkout without installing

    from convfirstnet.tools.convert_checkpoint import main

    raise SystemExit(main())
