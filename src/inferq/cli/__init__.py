"""The ``inferq`` command line."""
