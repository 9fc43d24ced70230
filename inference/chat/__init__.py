"""The chat page (web process): its views and conversations. Its replies are settled as requests end by inference/replies.py, which every process loads."""
