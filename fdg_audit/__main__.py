import signal
import sys

from .cli import main

code = main()
signal.signal(signal.SIGINT, signal.SIG_IGN)   # the command is done: a late Ctrl-C must not kill its exit (-2)
sys.exit(code)
