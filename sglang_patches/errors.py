"""The user-facing error of every sub-command (`patches`, `config`, `run`, `serve`, `engine`, `r3`): bad
input or a failed step, printed by the console script as one `error: ...` line with exit status 2.

It lives in the lowest package so that every area raises the same type without importing upward.
"""


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""
