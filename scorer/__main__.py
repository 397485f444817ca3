import sys

from .cli import main

if __name__ == "__main__":  # not when multiprocessing's spawn imports it
    sys.exit(main())
