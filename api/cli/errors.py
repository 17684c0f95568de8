"""Errors of the CLI layer."""


class UsageError(Exception):
    """Bad input from the user: exit status 2 with one line on stderr."""
