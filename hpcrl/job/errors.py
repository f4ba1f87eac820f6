"""The one exception type for a user's mistake: the CLI prints its message on one line, exit 2."""


class UserError(Exception):
    """A bad input: a recipe field, a flag, a site value. The message names the field and what is allowed."""
