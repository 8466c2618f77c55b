"""The one exception type for bad user input.

Entry points catch it and print its message alone (no traceback): the message must name the input,
what was expected and what to do.
"""


class DraftheadsError(Exception):
    """A problem with the user's input, configuration or files (not a bug in draftheads)."""


def cli(main):
    """Wrap a command-line entry point `main(argv=None) -> int | None`: a DraftheadsError prints its message alone
    (`error: ...` on stderr) and returns status 2. Tests call the wrapped function and read its status."""
    import functools
    import sys

    @functools.wraps(main)
    def run(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs) or 0
        except DraftheadsError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    return run


def exit_on_error(main) -> None:
    """Run `main` as the process's entry point (see `cli`) and exit with its status."""
    import sys

    sys.exit(cli(main)())
