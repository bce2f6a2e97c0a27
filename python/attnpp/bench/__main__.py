"""``python -m attnpp.bench``: the command line of attnpp.bench.cli."""
from .cli import main

main()
