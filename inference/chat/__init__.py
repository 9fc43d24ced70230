"""The chat page (web process): its views, conversations, and the receiver that settles a reply when its request ends."""
