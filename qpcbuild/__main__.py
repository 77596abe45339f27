"""`python -m qpcbuild` is the `qpcbuild` command."""

from .cli import main

main()
