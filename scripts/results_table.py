"""Regenerate the README results table from the committed records in benchmarks/results/.

python scripts/results_table.py                    # print it
python scripts/results_table.py --write README.md  # between <!-- results:start --> and <!-- results:end -->
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a source checkout, not installed
    from convfirstnet.tools.bench_report import main

    sys.exit(main())
