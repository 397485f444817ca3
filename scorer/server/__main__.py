"""``python -m scorer.server``: the same server as ``scorer serve``."""

import argparse
import sys

from .app import add_arguments, run

parser = argparse.ArgumentParser(prog="python -m scorer.server", description=__doc__)
add_arguments(parser)
sys.exit(run(parser.parse_args()))
