"""`python -m relu_ext.bench`: see relu_ext/bench/__init__.py."""

from .cli import main

main()
