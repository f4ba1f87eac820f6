"""`hpcrl run`'s own exit status, beside mpiexec's: what the supervisor returns for a run the user
stopped, which the summary and the failure line word as an interruption, not an error."""

INTERRUPTED = 130            # a run stopped by Ctrl-C or SIGTERM (128 + SIGINT)
