"""The one exception type for bad user input.

Entry points catch it and print its message alone (no traceback): the message must name the input,
what was expected and what to do.
"""


class DraftheadsError(Exception):
    """A problem with the user's input, configuration or files (not a bug in draftheads)."""
