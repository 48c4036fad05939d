"""Errors the user can fix: the CLI prints them as one line, without a traceback."""


class UserError(Exception):
    pass
