"""pytest set-up of the SDK suite: the `make_stack` fixture (see stack.py)."""

from stack import make_stack  # noqa: F401  (a fixture, found by pytest here)
