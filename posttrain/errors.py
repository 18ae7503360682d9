"""The base of every error a user can cause and fix (config, data, model path, rewards, checkpoints).

The command line prints these as one line, `posttrain: error: ...`, without a traceback.
"""


class UserError(Exception):
    """An error whose message names the cause and the fix."""
