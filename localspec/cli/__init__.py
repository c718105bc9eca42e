"""The `localspec` command line (entry point: localspec.cli.app:main).

Importing the CLI takes ~150 ms (typer, rich, the command modules). When this process is `localspec` itself, a
Ctrl-C in that time ends it at once with exit 130, instead of a KeyboardInterrupt traceback from inside an import;
main() then installs the handlers that keep a partial answer."""

import os
import signal
import sys


def stop_during_start_up(signum, frame) -> None:
    """Ctrl-C before main() runs: nothing has started, so nothing is lost."""
    os.write(2, b"\ninterrupted\n")
    os._exit(130)


def _is_the_program() -> bool:
    """Imported to run `localspec` (its script or `python -m localspec`), not by a program that embeds it."""
    arg0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    return os.path.basename(arg0) == "localspec" or arg0.endswith(os.path.join("localspec", "__main__.py"))


if _is_the_program() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    try:
        signal.signal(signal.SIGINT, stop_during_start_up)
    except ValueError:  # not the main thread
        pass
