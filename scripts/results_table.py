"""Regenerate the results table of docs/bench.md from the committed records in benchmarks/results/.

python scripts/results_table.py                        # print it
python scripts/results_table.py --write docs/bench.md  # between the results:start and results:end markers
"""

import sys

if __name__ == "__main__":  # runs the installed package (pip install -e . in a checkout)
    from convfirstnet.commands.results import main

    sys.exit(main())
