"""The supervised warm start that turns the tiny model into a weak but real initial policy."""
