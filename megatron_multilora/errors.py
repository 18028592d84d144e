"""The error a run ends with when something outside its config goes wrong once it is going: a
file that turns out damaged, a disk that fills up. Its message names the file and the way out;
the recipe prints it as the run's one error (no library traceback)."""


class RunError(RuntimeError):
    """A run cannot go on; the message says which file or resource, and what to do."""
