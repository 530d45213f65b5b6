"""The training loop and its parts: records, guards, collectives, what a checkpoint holds."""
