"""One error type for everything a user can fix: bad config, missing data, unknown plugin.

The CLI prints ``UserError`` as a single line (no traceback). Every message names the problem and the fix.
"""


class UserError(Exception):
    """A problem in the user's input, reported as one line that says what to change."""
