"""The one exception type for a bad routed-experts payload."""


class RoutedExpertsError(ValueError):
    """A routed-experts payload is unusable. ``str(err)`` is a one-line reason."""
