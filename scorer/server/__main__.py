"""python -m scorer.server: the same server as scorer serve."""

import argparse
import sys

from ..settings import SERVE, add_arguments
from . import run

if __name__ == "__main__":  # not when multiprocessing's spawn imports it (a front-end process)
    parser = argparse.ArgumentParser(prog="python -m scorer.server", description=__doc__)
    add_arguments(parser, SERVE)
    sys.exit(run(parser.parse_args()))
