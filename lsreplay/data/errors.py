"""The error bad data raises: its own module, so that every data module (the sources and the
generators they call) can raise it."""


class DatasetError(ValueError):
    """A prompt file or prompt-generation request that cannot be used as given."""
