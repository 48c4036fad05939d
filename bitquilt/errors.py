"""Errors the user can fix: the CLI prints them as one line, without a traceback."""


class UserError(Exception):
    pass


# What the CLI and the bench scripts report as one line instead of a traceback: UserError, plus the
# ValueError / FileNotFoundError that solvers, formats and loaders raise for input they reject.
USER_ERRORS = (UserError, ValueError, FileNotFoundError)
