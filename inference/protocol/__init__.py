"""Types and formats both processes agree on: log entries, the task payload, chunks, errors, tool-call text, the request parser."""
