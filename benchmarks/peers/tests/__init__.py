"""A package, so that pytest imports its conftest.py under a name of its own (tests/conftest.py
is the one named `conftest`, which the tests there import from)."""
