"""The first module a worker server imports (``workers.worker_context``'s preload): from here on it ignores Ctrl-C.

A terminal's Ctrl-C reaches the whole foreground process group, the forkserver included, while it still imports
torch (seconds): it died mid-import and printed a traceback (or oneMKL's FATAL line) after the harness's one-line
error. The harness handles Ctrl-C and stops every worker itself (audit/sandbox.py, ``stop_workers``).
"""
import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
