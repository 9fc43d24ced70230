"""Text that streams out before it is complete."""


def partial_tail(text, markers):
    """Length of the longest end of `text` that could still grow into one of `markers` (a stop
    string, a tool-call tag): that much must be held back until the next text decides it."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest
