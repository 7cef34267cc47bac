"""Inference benchmark (same as ``convfirstnet bench``); see convfirstnet/tools/benchmark.py.

python scripts/benchmark.py small --batch-sizes 128            # whole network, all backends
python scripts/benchmark.py --blocks all                       # paper Tables 1 and 2
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a source checkout, not installed
    from convfirstnet.tools.benchmark import main

    sys.exit(main())
