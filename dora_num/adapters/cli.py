"""``dora-num collapse``: registered into the CLI by :func:`register`."""


def register(sub) -> None:
    """Add this module's subcommands to the CLI's subparsers (none yet)."""
