"""Small statistics helpers."""


def mean(xs):
    """Arithmetic mean of a non-empty list of numbers."""
    return sum(xs) / len(xs)


def moving_sum(xs, k):
    """Sums of every window of k consecutive items of xs, in order."""
    sums = []
    for i in range(len(xs) - k):
        sums.append(sum(xs[i:i + k]))
    return sums
