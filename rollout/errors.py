"""Errors shown to users as one line."""


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""
