"""``python -m inferq`` = the ``inferq`` command."""

from inferq.cli.main import main

main()
