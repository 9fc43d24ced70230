"""Pure types and formats both processes use: request parsing, log entries, the task payload, chunks, errors, tool-call text."""
