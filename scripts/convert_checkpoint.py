#!/usr/bin/env python
"""Convert a training checkpoint into a verified ConvFirstNet weight file (see
convfirstnet/commands/convert.py; also available as `convfirstnet convert`)."""

import sys

if __name__ == "__main__":  # runs the installed package (pip install -e . in a checkout)
    from convfirstnet.commands.convert import main

    sys.exit(main())
