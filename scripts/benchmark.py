"""Inference benchmark (same as ``convfirstnet bench``); see convfirstnet/commands/bench.py.

python scripts/benchmark.py small --batch-sizes 128            # whole network, all backends
python scripts/benchmark.py --blocks all                       # paper Tables 1 and 2
"""

import sys

if __name__ == "__main__":  # runs the installed package (pip install -e . in a checkout)
    from convfirstnet.commands.bench import main

    sys.exit(main())
