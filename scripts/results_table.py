"""Regenerate the README results table from the committed records in benchmarks/results/.

python scripts/results_table.py                    # print it
python scripts/results_table.py --write README.md  # between <!-- results:start --> and <!-- results:end -->
"""

import sys

if __name__ == "__main__":  # runs the installed package (pip install -e . in a checkout)
    from convfirstnet.commands.results import main

    sys.exit(main())
