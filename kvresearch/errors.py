"""The one exception type that stages turn into a short message instead of a traceback."""


class KVResearchError(RuntimeError):
    """A problem the user can fix: the message says what is wrong and what to do."""
