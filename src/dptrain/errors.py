"""Errors a user can cause: reported as one sentence and exit code 2, never a traceback."""


class UserError(Exception):
    """Bad input from the user (config, data, model, paths).

    The message is one sentence that names the bad value and what would be valid.
    The CLI prints it and exits with code 2; programming errors stay loud tracebacks.
    """

    exit_code = 2
