"""`python -m qpcbuild` is the `qpcbuild` command."""

from .launch import main

main()
