"""Text helpers."""


def slugify(s):
    """Turn s into a URL slug, e.g. "Hello, World!" -> "hello-world"."""
    # TODO: handle punctuation, accents and repeated separators.
    return s.lower().replace(" ", "-")
