"""Prompts: the user's files, the built-in sets, and the stream a run trains on."""
