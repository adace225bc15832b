"""The command line (``nanguard run``, ``nanguard demo``): an edge of the package; nothing imports it."""
