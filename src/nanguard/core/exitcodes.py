"""Exit statuses of ``nanguard run``, shared by the command line and the demo."""
EXIT_NONFINITE = 3  # nanguard stopped the run at a non-finite value
EXIT_USAGE = 2      # a usage error (no such script)
