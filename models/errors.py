"""The one exception type for bad user input.

Entry points catch it and print its message alone (no traceback): the message must name the input,
what was expected and what to do.
"""


class DraftheadsError(Exception):
    """A problem with the user's input, configuration or files (not a bug in draftheads)."""


def exit_on_error(main) -> None:
    """Run a command-line entry point: a DraftheadsError prints its message alone and exits with status 2."""
    import sys

    try:
        main()
    except DraftheadsError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
