import signal
import sys

try:
    from .cli import main
except ImportError as e:   # e.g. run from a clone before installing it: a dependency is missing
    print(f"error: fdg_audit cannot start ({e}): install it first (README: pip install torch==2.13.0 && pip install "
          f"-e <the clone>), and run it outside any folder that holds another folder named fdg_audit", file=sys.stderr)
    sys.exit(2)

code = main()
signal.signal(signal.SIGINT, signal.SIG_IGN)   # the command is done: a late Ctrl-C must not kill its exit (-2)
sys.exit(code)
