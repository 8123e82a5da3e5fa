"""The cachecd command line as it runs on macOS, run here: ``python -m tests.simulated_darwin ARGS``.

cachecd decides its platform from ``sys.platform``, mostly when a module is imported (the
default paths in ``cachecd.constants``, the service manager ``cachecd service`` picks, the
socket path limit, whether cache dirs are kept from Spotlight and Time Machine). This imports
cachecd and every command module once as they are, so the standard library and the third-party
modules they use load for the system that runs them (some cannot load for another one:
``urllib.request`` wants macOS's ``_scproxy``), then sets ``sys.platform`` to "darwin", drops
cachecd's own modules and runs the command line: cachecd loads again and takes every Darwin
branch. What needs macOS itself (launchctl, setxattr(2), F_FULLFSYNC, LOCAL_PEERCRED) fails here
as it would on any machine without it; tests use this for what a Mac user is shown and what
would be written, and the tests marked ``macos`` run the rest on a Mac.
"""

from __future__ import annotations

import sys


def run(argv: list[str]) -> int:
    from cachecd.cli import build_parser

    build_parser()  # imports every command module, and what they import, for this system
    sys.platform = "darwin"
    for name in [m for m in sys.modules if m == "cachecd" or m.startswith(("cachecd.", "cachecd_"))]:
        del sys.modules[name]
    from cachecd.cli import main

    return main(argv)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
